"""Tokenizes text with a Hugging Face tokenizer (a model folder's own, e.g. a pretrained
BERT's WordPiece) into the file `tempo train --data` reads: a safetensors file with the ids
("ids", int32, the files' texts in sorted order, each followed by the separator token) and
"meta" = [vocab_size, mask_id, pad_id].

    python -m tempo.pretokenize --tokenizer MODEL_DIR --data FILE|DIR --out IDS.safetensors
"""

import argparse
import os
import sys


# What a Hugging Face tokenizer folder holds (one at least): fast, then slow tokenizers' files.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def fail(message):
    """A mistake in the input: the message on stderr, exit 2 (as tempo train)."""
    print("tempo.pretokenize: " + message, file=sys.stderr)
    raise SystemExit(2)


def is_binary(path):
    """A NUL byte in the first 8 KiB: not text (as tempo train and grep decide)."""
    try:
        with open(path, "rb") as f:
            return b"\0" in f.read(8192)
    except OSError as e:
        fail("cannot read %s: %s" % (path, e.strerror or e))


def text_files(path):
    """The file, or the regular text files under the folder, sorted; and the binary files left out."""
    if os.path.isfile(path):
        if is_binary(path):
            fail("%s is not text (it holds NUL bytes)" % path)
        return [path], []
    if os.path.isdir(path):
        found = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
        found = [f for f in found if os.path.isfile(f)]  # not devices or pipes, which cannot be read as files
        binary = [f for f in found if is_binary(f)]
        files = sorted(set(found) - set(binary))
        if files:
            return files, binary
        fail("%s holds no text files" % path)
    if os.path.exists(path):
        fail("%s is neither a file nor a folder" % path)
    fail("no such file or directory: %s" % path)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tempo.pretokenize", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="a folder with a Hugging Face tokenizer (offline)")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-bytes", type=int, default=0, help="stop after this many bytes of text (0: all)")
    a = p.parse_args(argv)
    if a.max_bytes < 0:
        p.error("--max-bytes must be >= 0 (0: all), got %d" % a.max_bytes)
    files, binary = text_files(a.data)  # the cheap checks before loading transformers
    if not os.path.isdir(a.tokenizer):
        fail(
            "--tokenizer %s is not a folder (a model folder with its tokenizer files; nothing is downloaded)"
            % a.tokenizer
        )
    if not any(os.path.isfile(os.path.join(a.tokenizer, f)) for f in _TOKENIZER_FILES):
        fail("--tokenizer %s holds no tokenizer files (one of %s)" % (a.tokenizer, ", ".join(_TOKENIZER_FILES)))
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        fail("cannot write --out %s: %s is not a writable folder" % (a.out, out_dir))
    import torch
    import transformers
    from safetensors.torch import save_file

    try:
        tok = transformers.AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    except Exception as e:  # no tokenizer files, a damaged one, a converter that is not installed
        why = str(e).strip().splitlines() or [type(e).__name__]
        fail("cannot load a tokenizer from %s: %s" % (a.tokenizer, why[-1]))
    sep = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
    ids, total = [], 0
    for f in files:
        raw = open(f, "rb").read()
        if a.max_bytes:
            raw = raw[: max(a.max_bytes - total, 0)]
        total += len(raw)
        text = raw.decode("utf-8", errors="replace")  # a character cut at the limit becomes one U+FFFD
        start = len(ids)
        for para in text.split("\n\n"):
            if para.strip():
                ids.extend(tok(para, add_special_tokens=False)["input_ids"])
        if sep is not None and len(ids) > start:
            ids.append(sep)
        if a.max_bytes and total >= a.max_bytes:
            break
    if not ids:
        fail("%s holds no text" % a.data)
    mask = tok.mask_token_id if tok.mask_token_id is not None else -1
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    tmp = a.out + ".tmp"  # renamed when whole: a full disk leaves no cut-short file for tempo train
    try:
        save_file(
            {
                "ids": torch.tensor(ids, dtype=torch.int32),
                "meta": torch.tensor([len(tok), mask, pad], dtype=torch.int64),
            },
            tmp,
        )
        os.replace(tmp, a.out)
    except Exception as e:  # OSError, or safetensors' own error for a failed write
        if os.path.exists(tmp):
            os.remove(tmp)
        print("tempo.pretokenize: writing %s failed: %s" % (a.out, getattr(e, "strerror", None) or e), file=sys.stderr)
        return 1
    if binary:
        print(
            "left out %d binary file%s under %s (%s%s)"
            % (len(binary), "s" if len(binary) > 1 else "", a.data, binary[0], ", ..." if len(binary) > 1 else "")
        )
    print("%d tokens from %d bytes -> %s (vocabulary %d, [MASK] %d)" % (len(ids), total, a.out, len(tok), mask))
    return 0


if __name__ == "__main__":
    sys.exit(main())

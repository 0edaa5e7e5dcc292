"""Tokenizes text with a Hugging Face tokenizer (a model folder's own, e.g. a pretrained
BERT's WordPiece) into the file `tempo train --data` reads: a safetensors file with the ids
("ids", int32, the files' texts in sorted order, each followed by the separator token) and
"meta" = [vocab_size, mask_id, pad_id].

    python -m tempo.pretokenize --tokenizer MODEL_DIR --data FILE|DIR --out IDS.safetensors
"""
import argparse
import os
import sys


def text_files(path):
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
        if files:
            return files
        raise SystemExit("tempo.pretokenize: %s holds no files" % path)
    raise SystemExit("tempo.pretokenize: no such file or directory: %s" % path)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tempo.pretokenize", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="a folder with a Hugging Face tokenizer (offline)")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-bytes", type=int, default=0, help="stop after this many bytes of text (0: all)")
    a = p.parse_args(argv)
    import torch
    import transformers
    from safetensors.torch import save_file

    tok = transformers.AutoTokenizer.from_pretrained(a.tokenizer)
    sep = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
    ids, total = [], 0
    for f in text_files(a.data):
        raw = open(f, "rb").read()
        if a.max_bytes:
            raw = raw[: max(a.max_bytes - total, 0)]
        total += len(raw)
        text = raw.decode("utf-8", errors="replace")  # a character cut at the limit becomes one U+FFFD
        for para in text.split("\n\n"):
            if para.strip():
                ids.extend(tok(para, add_special_tokens=False)["input_ids"])
        if sep is not None:
            ids.append(sep)
        if a.max_bytes and total >= a.max_bytes:
            break
    if not ids:
        sys.exit("tempo.pretokenize: %s holds no text" % a.data)
    mask = tok.mask_token_id if tok.mask_token_id is not None else -1
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    save_file({"ids": torch.tensor(ids, dtype=torch.int32),
               "meta": torch.tensor([len(tok), mask, pad], dtype=torch.int64)}, a.out)
    print("%d tokens from %d bytes -> %s (vocabulary %d, [MASK] %d)" % (len(ids), total, a.out, len(tok), mask))
    return 0


if __name__ == "__main__":
    sys.exit(main())

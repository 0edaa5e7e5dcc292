#!/usr/bin/env python3
"""Rewrites a CUDA source of tempo's core into C++ that tests/simt/cuda_runtime.h runs on the
host: the two constructs a C++ compiler cannot read become calls into that header.

  kernel<Args><<<grid, block, shared, stream>>>(a, b);
      -> ::simt::launch(grid, block, shared, [&] { kernel<Args>(a, b); });
  extern __shared__ double sh[];
      -> double* sh = ::simt::dynamic_shared<double>();

Everything else is left as written, and the line numbers are kept (a launch written over
several lines stays on as many), so that the emulator's messages name the source's lines.

Usage: translate.py IN.cu OUT.cpp
"""

import re
import sys


def matching(text, i, open_ch, close_ch):
    """Index just past the bracket that closes the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_ch:
            depth += 1
        elif text[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j + 1
    raise SystemExit("translate.py: unbalanced %s at offset %d" % (open_ch, i))


def kernel_start(text, i):
    """Where the kernel expression that ends at text[i] (just before <<<) begins: back over
    a template argument list and a qualified name (clang-format may break the line before <<<)."""
    j = i
    while text[j - 1].isspace():
        j -= 1
    while True:
        if text[j - 1] == ">":  # template arguments
            depth = 0
            while True:
                j -= 1
                if text[j] == ">":
                    depth += 1
                elif text[j] == "<":
                    depth -= 1
                    if depth == 0:
                        break
        k = j
        while k > 0 and (text[k - 1].isalnum() or text[k - 1] == "_"):
            k -= 1
        if k == j:
            raise SystemExit("translate.py: no kernel name before <<< at offset %d" % i)
        j = k
        if text[j - 2 : j] == "::":
            j -= 2
            continue
        return j


def split_top(args):
    """Splits a launch configuration at its top-level commas."""
    parts, depth, cur = [], 0, ""
    for ch in args:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


def translate(text):
    out, pos = [], 0
    for m in re.finditer(r"<<<", text):
        if m.start() < pos:
            continue
        start = kernel_start(text, m.start())
        cfg_end = text.index(">>>", m.end())
        config = split_top(text[m.end() : cfg_end])
        if not 2 <= len(config) <= 4:
            raise SystemExit("translate.py: a launch configuration of %d parts" % len(config))
        shared = config[2] if len(config) > 2 else "0"
        k = cfg_end + 3
        while text[k].isspace():
            k += 1
        if text[k] != "(":
            raise SystemExit("translate.py: no arguments after >>> at offset %d" % k)
        args_end = matching(text, k, "(", ")")
        out.append(text[pos:start])
        out.append(
            "::simt::launch(dim3(%s), dim3(%s), static_cast<size_t>(%s), [&] { %s%s; })"
            % (config[0], config[1], shared, text[start : m.start()], text[k:args_end])
        )
        pos = args_end
    out.append(text[pos:])
    text = "".join(out)
    return re.sub(
        r"extern\s+__shared__\s+([\w:]+)\s+(\w+)\s*\[\s*\]\s*;", r"\1* \2 = ::simt::dynamic_shared<\1>();", text
    )


# An op's CUDA entry point, as each .cu defines it: Status <entry>_cuda(const <Params>& p, void* stream)
ENTRY = re.compile(r"^Status (\w+)_cuda\(const (\w+)& \w+, void\* \w+\)", re.M)


def registrations(text):
    """The lines that register each entry point of the source with tests/simt/api.h's table, by
    name (`tempo` is the emulated build's namespace there)."""
    out = ['\n#include "api.h"\nnamespace {\n']
    for entry, params in ENTRY.findall(text):
        out.append(
            'const bool simt_entry_%s = ::simt_api::register_entry("%s", [](const void* params) {\n'
            "  const ::tempo::Status s = ::tempo::%s_cuda(*static_cast<const ::tempo::%s*>(params), nullptr);\n"
            "  return s.ok() ? std::string() : s.message();\n"
            "});\n" % (entry, entry, entry, params)
        )
    out.append("}  // namespace\n")
    return "".join(out)


def main():
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        text = f.read()
    body = translate(text)
    with open(dst, "w") as f:
        f.write('#line 1 "%s"\n' % src)
        f.write(body)
        f.write(registrations(text))


if __name__ == "__main__":
    main()

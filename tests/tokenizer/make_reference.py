#!/usr/bin/env python3
"""Reference data for torchspeed's GPT-2 byte-level BPE tokenizer, made by Hugging Face's
`tokenizers` package: a ByteLevel BPE trained on the fortunes corpus (saved as tokenizer.json and
as GPT-2's vocab.json + merges.txt), every corpus file's text as `tokenizers` sees it, and the ids
it gives each file. tokenizer_check (C++) then encodes the same texts and compares.

usage: make_reference.py CORPUS_DIR OUT_DIR [VOCAB_SIZE]
"""
import json
import os
import sys

from tokenizers import ByteLevelBPETokenizer


def main():
    corpus, out = sys.argv[1], sys.argv[2]
    vocab_size = int(sys.argv[3]) if len(sys.argv) > 3 else 4000
    os.makedirs(os.path.join(out, "texts"), exist_ok=True)
    files = []
    for name in sorted(os.listdir(corpus)):
        path = os.path.join(corpus, name)
        if name.endswith(".dat") or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        text_path = os.path.join(out, "texts", name + ".txt")
        with open(text_path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        files.append((name, text_path, text))
    tok = ByteLevelBPETokenizer()  # GPT-2's: ByteLevel pre-tokenizer without a prefix space
    tok.train([p for _, p, _ in files], vocab_size=vocab_size, min_frequency=2)
    tok.save(os.path.join(out, "tokenizer.json"))
    tok.save_model(out)  # vocab.json, merges.txt
    ids = {name: tok.encode(text).ids for name, _, text in files}
    with open(os.path.join(out, "ids.json"), "w") as f:
        json.dump({"files": [n for n, _, _ in files], "ids": ids}, f)
    print("reference: %d files, %d tokens, vocab %d" % (len(files), sum(len(v) for v in ids.values()),
                                                       tok.get_vocab_size()))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Byte-level BPE tokenizers with each family's pre-tokenizer, trained by Hugging Face's
`tokenizers` on the fortunes corpus and saved as tokenizer.json, for torchspeed to read and
match id for id (tests/tokenizer/families.sh):
  gpt2    ByteLevel (GPT-2's pattern)
  smollm  Sequence [Digits(individual_digits), ByteLevel]             (SmolLM, SmolLM2)
  llama3  Sequence [Split(Llama 3's regex, Isolated), ByteLevel(no regex)], ignore_merges
  qwen2   NFC normalizer; Sequence [Split(Qwen2's regex, Isolated), ByteLevel(no regex)]
  llama2  SentencePiece-style BPE with byte fallback, Llama 2's form: normalizer Sequence
          [Prepend("▁"), Replace(" ", "▁")], no pre-tokenizer, fuse_unk, and a
          TemplateProcessing post-processor that starts every text with <s>
  mistral the same model in Mistral's later form: Metaspace(prepend_scheme "first", no split)
The patterns are those of Llama 3's and Qwen2's own tokenizer.json; the SentencePiece forms are
those of Llama 2's and Mistral's tokenizer.json (trained on words split at "▁", as
SentencePiece trains, with a small alphabet so that rarer characters take the byte fallback).

usage: make_family_tokenizers.py OUT_DIR
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "hf"))
from checks import corpus_files  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus():
    return corpus_files()


SPM_SPECIALS = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]


def make_spm(kind, out_path, vocab_size=3000):
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False, limit_alphabet=120,
                                  special_tokens=SPM_SPECIALS)
    tok.train(corpus(), trainer)
    tok.save(out_path)
    j = json.load(open(out_path, encoding="utf-8"))
    meta = "\u2581"
    # As in Llama 2's own tokenizer.json, the <0xXX> tokens are vocabulary entries, not added tokens.
    j["added_tokens"] = [a for a in j["added_tokens"] if a["content"] in ("<unk>", "<s>", "</s>")]
    if kind == "llama2":
        # Llama 2's post-processor: every encoded text starts with <s> (add_special_tokens).
        bos = j["model"]["vocab"]["<s>"]
        j["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}}}
        j["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": meta}, {"type": "Replace", "pattern": {"String": " "}, "content": meta}]}
        j["pre_tokenizer"] = None
        strip = [{"type": "Strip", "content": " ", "start": 1, "stop": 0}]
    else:
        j["normalizer"] = None
        j["pre_tokenizer"] = {"type": "Metaspace", "replacement": meta, "prepend_scheme": "first", "split": False}
        strip = [{"type": "Strip", "content": " ", "start": 1, "stop": 0}]
    j["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": meta}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}] + strip}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False)
    return Tokenizer.from_file(out_path)


def make(kind):
    tok = Tokenizer(models.BPE(ignore_merges=(kind == "llama3")))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if kind == "gpt2":
        tok.pre_tokenizer = byte_level
    elif kind == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif kind == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3), "isolated"), no_regex])
    elif kind == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2), "isolated"), no_regex])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train(corpus(), trainer)
    return tok


def main():
    out = sys.argv[1]
    for kind in ("gpt2", "smollm", "llama3", "qwen2", "llama2", "mistral"):
        d = os.path.join(out, kind)
        os.makedirs(d, exist_ok=True)
        if kind in ("llama2", "mistral"):
            tok = make_spm(kind, os.path.join(d, "tokenizer.json"))
        else:
            tok = make(kind)
            tok.save(os.path.join(d, "tokenizer.json"))
        print("make_family_tokenizers: %s: %d tokens" % (d, tok.get_vocab_size()))


if __name__ == "__main__":
    main()

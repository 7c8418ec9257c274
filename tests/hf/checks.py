"""What the Python parity scripts share (gpt2_parity, families_parity, llamacpp_parity,
tokenizer/make_family_tokenizers): the fortunes corpus's files and the check counter that makes
a script fail on its exit status."""
import os
import sys

FORTUNES = "/usr/share/games/fortunes"
failures = []
_count = [0]


def check(ok, what):
    """Counts a check; a failed one prints "FAIL what" and is remembered for finish()."""
    _count[0] += 1
    if not ok:
        failures.append(what)
        print("FAIL " + what, flush=True)


def finish(name):
    """Exits 1 when a check failed, else prints how many passed."""
    if failures:
        print("%s: %d of %d checks failed" % (name, len(failures), _count[0]), flush=True)
        sys.exit(1)
    print("%s: all %d checks passed" % (name, _count[0]), flush=True)


def corpus_files():
    """The fortunes corpus's text files (not the .dat indexes, not the links), sorted."""
    out = []
    for name in sorted(os.listdir(FORTUNES)):
        p = os.path.join(FORTUNES, name)
        if name.endswith(".dat") or os.path.islink(p) or not os.path.isfile(p):
            continue
        out.append(p)
    return out

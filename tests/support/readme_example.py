"""Exits 0 when README.md shows examples/quickstart.cpp verbatim in a ```cpp block, so the
README's example is the program CI builds and runs. Usage: readme_example.py README.md FILE"""
import re
import sys

readme, path = sys.argv[1], sys.argv[2]
source = open(path, encoding="utf-8").read()
blocks = re.findall(r"```cpp\n(.*?)```", open(readme, encoding="utf-8").read(), re.S)
if source not in blocks:
    print(f"{readme}: no ```cpp block equals {path}; copy the file into the README", flush=True)
    sys.exit(1)
print(f"{readme} shows {path} verbatim ({source.count(chr(10))} lines)")

"""cmake/check_layers.py against small trees: a downward include passes, an upward one fails
naming the file, line and both floors, and a folder with no floor fails. Then the real src/
passes. Usage: check_layers_test.py CHECK_LAYERS_PY SRC_DIR"""
import os
import subprocess
import sys
import tempfile

script, real_src = sys.argv[1], sys.argv[2]
failures = 0


def tree(files):
    root = tempfile.mkdtemp(prefix="layers-")
    for path, text in files.items():
        full = os.path.join(root, "torchspeed", path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as fh:
            fh.write(text)
    return root


def run(src):
    p = subprocess.run([sys.executable, script, src], capture_output=True, text=True)
    return p.returncode, p.stderr


def expect(what, ok):
    global failures
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    failures += 0 if ok else 1


rc, err = run(tree({"base/error.h": "#pragma once\n", "engine/engine.h": '#include "torchspeed/base/error.h"\n'}))
expect("a higher floor includes a lower one", rc == 0 and err == "")
rc, err = run(tree({"base/error.h": '#pragma once\n#include <vector>\n#include "torchspeed/engine/engine.h"\n',
                    "engine/engine.h": "#pragma once\n"}))
expect("an upward include fails, naming the file, line and floors",
       rc == 1 and "src/torchspeed/base/error.h:3: includes torchspeed/engine/ (floor 'top') from floor 'base'" in err)
rc, err = run(tree({"zero/a.cpp": '#include "torchspeed/offload/b.h"\n', "offload/b.h": '#include "torchspeed/zero/c.h"\n',
                    "zero/c.h": ""}))
expect("folders of one floor include each other", rc == 0)
rc, err = run(tree({"newthing/a.cpp": "int x;\n"}))
expect("a folder with no floor fails", rc == 1 and "src/torchspeed/newthing/: a folder with no floor" in err)
rc, err = run(real_src)
expect("the library's own sources keep their floors" + (": " + err if rc else ""), rc == 0)
sys.exit(1 if failures else 0)

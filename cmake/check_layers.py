"""The library's floors, lowest first, and the check the build runs: a source under
src/torchspeed/<folder>/ may include headers of its own floor and of the floors below it, never of
a floor above. `cmake --build` runs this before compiling the library (target
torchspeed_layers), so an upward include fails the build, naming the file, the line and both
floors. Usage: check_layers.py SRC_DIR [STAMP]

Folders of one floor may include each other. Floors hold several folders where the code still has
mutual includes (checkpoint/ and models/: a checkpoint format reads a model's description, and
models/ reads PEFT adapters; data/'s tokenizers read GGUF files through checkpoint/); splitting
those is how a floor gets narrower (docs/architecture.md)."""
import os
import re
import sys

FLOORS = [
    ("base", ["base"]),                         # errors, logging, files, CPU, memory; no MPI
    ("io", ["io"]),                             # safetensors, GGUF, atomic writes, CRC-32C
    ("monitor", ["monitor"]),                   # progress, CSV / TensorBoard metrics, profiles
    ("comm", ["comm"]),                         # MPI and the communicator
    ("parallel", ["parallel", "tensor_parallel", "optim", "precision"]),
    ("config", ["config"]),                     # DeepSpeed JSON -> typed structs
    ("layers", ["nn", "compression"]),
    ("sharding", ["zero", "offload", "pipeline"]),
    ("models", ["models", "checkpoint", "data"]),
    ("planning and inference", ["plan", "inference"]),
    ("top", ["engine", "serve"]),
    ("launch", ["launch"]),                     # hostfiles, spawning, elastic restarts: for the CLI only
]


def main():
    src = sys.argv[1]
    floor_of = {}
    for i, (_, folders) in enumerate(FLOORS):
        for f in folders:
            floor_of[f] = i
    root = os.path.join(src, "torchspeed")
    include = re.compile(r'^\s*#\s*include\s+[<"]torchspeed/([A-Za-z_]+)/')
    errors = []
    for folder in sorted(os.listdir(root)):
        path = os.path.join(root, folder)
        if not os.path.isdir(path):
            continue
        if folder not in floor_of:
            errors.append(f"src/torchspeed/{folder}/: a folder with no floor; add it to FLOORS in cmake/check_layers.py")
            continue
        for dirpath, _, files in os.walk(path):
            for name in sorted(files):
                if not name.endswith((".h", ".cpp")):
                    continue
                file = os.path.join(dirpath, name)
                with open(file, encoding="utf-8") as fh:
                    for n, line in enumerate(fh, 1):
                        m = include.match(line)
                        if not m:
                            continue
                        target = m.group(1)
                        if target not in floor_of:
                            continue
                        if floor_of[target] > floor_of[folder]:
                            rel = os.path.relpath(file, src)
                            errors.append(
                                f"src/{rel}:{n}: includes torchspeed/{target}/ (floor '{FLOORS[floor_of[target]][0]}') "
                                f"from floor '{FLOORS[floor_of[folder]][0]}': a lower floor never includes a higher one "
                                f"(cmake/check_layers.py, docs/architecture.md)")
    if errors:
        print("\n".join(errors), file=sys.stderr)
        sys.exit(1)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as fh:
            fh.write("layers ok\n")


if __name__ == "__main__":
    main()

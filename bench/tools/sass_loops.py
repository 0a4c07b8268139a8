r"""The loops of each kernel's SASS and their instruction mix: a CPU-side count of what a kernel's main loop issues.

    python3 bench/tools/sass_loops.py cuda/mma_one_row.cu --kernel 'mma_one_row_kernel<\(ti::WFormat\)0' --min 40
    python3 bench/tools/sass_loops.py cuda/mma_one_row.cu --sub 'if (c < full_chunks) {=if (true) {'

A .cu file is compiled for sm_90 the way the build compiles it (nvcc -cubin, -O3, the repository's includes); a
.cubin is read as is. cuobjdump comes from beside nvcc, the PATH, or NVIDIA's wheel (`pip install
"cuda-toolkit[cuobjdump]"`). Each loop is a backward branch: its instructions, its opcodes (most frequent first,
predicates stripped) and its global / shared loads by width. --sub OLD=NEW compiles a copy of the source with OLD
replaced (once or more) by NEW: how to count one path of a loop, e.g. a kernel's whole-chunk path without the row's
last chunk (docs/perf/persistent.md §27; the copy, cuda/_sass_loops_*.cu beside the original so that its includes
resolve, is removed after the compile and git-ignored). Removing a branch changes the code around it a little. Where
a loop's body is bound by instruction issue, time follows its count; where it waits for bytes it does not."""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVCC_FLAGS = ["-std=c++17", "--expt-relaxed-constexpr", "-arch=sm_90", "-O3", "-I.", "-Icpp", "-DTINYINFER_CUDA",
              "-DTINYINFER_WITH_CUDA", "-cubin"]
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def parse(sass: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass text -> {mangled kernel name: [(address, instruction text), ...]}."""
    kernels: dict[str, list[tuple[int, str]]] = {}
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name, _, body = part.partition("\n")
        kernels[name.strip()] = [(int(m.group(1), 16), m.group(2)) for m in _INSN.finditer(body)]
    return kernels


def opcode(text: str) -> str:
    """The opcode of an instruction (its predicate dropped), with its modifiers: "LDG.E.128"."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def loops(insns: list[tuple[int, str]]) -> list[dict]:
    """Every backward branch's loop: start and end address, instruction count, opcode mix, loads by width."""
    at = {a: i for i, (a, _) in enumerate(insns)}
    found = []
    for i, (a, text) in enumerate(insns):
        if not opcode(text).startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)", text)
        target = int(m.group(1), 16) if m else None
        if target is None or target >= a or target not in at:
            continue
        body = [opcode(t) for _, t in insns[at[target]:i + 1]]
        mix = collections.Counter(op.split(".")[0] for op in body)
        loads = collections.Counter(op for op in body if op.startswith(("LDG", "LDS")))
        found.append({"start": target, "end": a, "count": len(body), "mix": dict(mix.most_common()),
                      "loads": dict(sorted(loads.items()))})
    return found


def demangle(names: list[str]) -> list[str]:
    if not shutil.which("c++filt"):
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return out[:len(names)]


def tool(name: str) -> str:
    """cuobjdump / nvcc: beside the system's nvcc, on the PATH, or in NVIDIA's PyPI wheels."""
    for d in [os.path.dirname(shutil.which("nvcc") or ""), "/usr/local/cuda/bin",
              *glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cu*", "bin"))]:
        if d and os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    if shutil.which(name):
        return shutil.which(name)
    sys.exit(f"sass_loops: no {name} (install the CUDA toolkit, or pip install \"cuda-toolkit[{name}]\")")


def cubin_of(path: str, subs: list[str], tmp: str) -> str:
    if path.endswith(".cubin"):
        return path
    src = path
    if subs:
        text = open(path).read()
        for s in subs:
            old, sep, new = s.partition("=")
            if not sep or old not in text:
                sys.exit(f"sass_loops: --sub {s!r}: expected OLD=NEW with OLD in {path}")
            text = text.replace(old, new)
        # beside the original, so that its relative includes resolve
        src = os.path.join(os.path.dirname(os.path.abspath(path)), "_sass_loops_" + os.path.basename(path))
        with open(src, "w") as f:
            f.write(text)
    out = os.path.join(tmp, "k.cubin")
    try:
        subprocess.run([tool("nvcc"), *NVCC_FLAGS, os.path.abspath(src), "-o", out], cwd=ROOT, check=True)
    finally:
        if src != path:
            os.remove(src)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", help="a .cu file of the repository, or a .cubin")
    ap.add_argument("--kernel", default="", help="only kernels whose demangled name matches this regex")
    ap.add_argument("--min", type=int, default=20, help="only loops of at least this many instructions")
    ap.add_argument("--sub", action="append", default=[], help="OLD=NEW: compile a copy with OLD replaced by NEW")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = cubin_of(a.file, a.sub, tmp)
        sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    kernels = parse(sass)
    for name, pretty in zip(kernels, demangle(list(kernels))):
        if not re.search(a.kernel, pretty):
            continue
        shown = [lp for lp in loops(kernels[name]) if lp["count"] >= a.min]
        print(f"{pretty}  ({len(kernels[name])} instructions)")
        for lp in shown:
            mix = " ".join(f"{k} {v}" for k, v in lp["mix"].items())
            loads = " ".join(f"{k} {v}" for k, v in lp["loads"].items())
            print(f"  loop {lp['start']:#x}-{lp['end']:#x}: {lp['count']} instructions | {mix} | loads: {loads}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

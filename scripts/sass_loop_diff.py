#!/usr/bin/env python3
"""Compares a kernel's hot loop between two builds, from their SASS.

ptxas re-schedules a whole loop when code near it changes, and on these kernels a new schedule
alone has moved the time by +-2 % (docs/PERF.md, items 75 and 81-83). Before spending device time
on a candidate, compare its loop with main's: the number of instructions, the opcode mix, and how
many of them differ (a sequence alignment over the opcodes with register numbers and immediates
masked). A handful changed means the candidate's own edit; hundreds mean a new schedule, which
only an alternating A/B on the GPU can judge.

    cuobjdump -sass main.cubin > a.sass; cuobjdump -sass candidate.cubin > b.sass
    scripts/sass_loop_diff.py a.sass b.sass backward_kernel ELb1ELb0ELNS1_10DqAdditionE0 --mma 20

The loop is the smallest backward branch whose body holds at least --mma wgmma instructions
(QGMMA/HGMMA) and --min instructions: the backward's step loop has 20, the forward's visible-tile
loop 8.
"""
import argparse
import collections
import difflib
import re
import sys

INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
MASKED = re.compile(r"\bU?R\d+\b|\bU?P\d\b|0x[0-9a-f]+")


def functions(sass_text):
    """(name, [(address, instruction)]) for each function of a cuobjdump -sass listing."""
    for chunk in re.split(r"\n\s+Function : ", sass_text)[1:]:
        name, body = chunk.split("\n", 1)
        code = [(int(m.group(1), 16), m.group(2)) for m in map(INSTRUCTION.match, body.split("\n"))
                if m]
        yield name.strip(), code


def opcode(instruction):
    words = instruction.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def hot_loop(code, min_mma, min_size):
    """The smallest loop (body of a backward branch) with enough wgmma instructions."""
    index = {address: i for i, (address, _) in enumerate(code)}
    best = None
    for i, (address, text) in enumerate(code):
        m = BRANCH_TARGET.search(text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= address or target not in index:
            continue
        body = [t for _, t in code[index[target]:i + 1]]
        mma = sum(opcode(t) in ("QGMMA", "HGMMA") for t in body)
        if mma >= min_mma and len(body) >= min_size and (best is None or len(body) < len(best)):
            best = body
    return best


def find(path, patterns, min_mma, min_size):
    with open(path) as f:
        text = f.read()
    for name, code in functions(text):
        if all(p in name for p in patterns):
            loop = hot_loop(code, min_mma, min_size)
            if loop is None:
                sys.exit(f"{path}: {name}: no loop with {min_mma} wgmma instructions")
            return name, loop
    sys.exit(f"{path}: no function whose name contains all of {patterns}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", help="cuobjdump -sass listing of the reference build")
    ap.add_argument("after", help="cuobjdump -sass listing of the candidate")
    ap.add_argument("patterns", nargs="+", help="substrings of the (mangled) kernel name")
    ap.add_argument("--mma", type=int, default=8, help="wgmma instructions in the loop (8)")
    ap.add_argument("--min", type=int, default=200, help="instructions in the loop at least (200)")
    ap.add_argument("--show", type=int, default=0, help="print this many differing runs")
    args = ap.parse_args()

    name, a = find(args.before, args.patterns, args.mma, args.min)
    _, b = find(args.after, args.patterns, args.mma, args.min)
    mask = lambda t: MASKED.sub("#", t)
    matcher = difflib.SequenceMatcher(None, [mask(t) for t in a], [mask(t) for t in b],
                                      autojunk=False)
    runs = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    changed = sum(max(i2 - i1, j2 - j1) for _, i1, i2, j1, j2 in runs)
    print(f"{name[:100]}")
    print(f"loop: {len(a)} -> {len(b)} instructions, {changed} differ in {len(runs)} runs")
    count_a = collections.Counter(map(opcode, a))
    count_b = collections.Counter(map(opcode, b))
    moved = {op: count_b[op] - count_a[op] for op in count_a | count_b if count_b[op] != count_a[op]}
    if moved:
        print("opcode counts: " + ", ".join(f"{op} {d:+d}" for op, d in sorted(moved.items())))
    for tag, i1, i2, j1, j2 in runs[:args.show]:
        print(f"  {tag} {i1}:{i2} -> {j1}:{j2}")
        for t in a[i1:i2][:6]:
            print(f"    - {t}")
        for t in b[j1:j2][:6]:
            print(f"    + {t}")


if __name__ == "__main__":
    main()

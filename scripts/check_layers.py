#!/usr/bin/env python3
"""Checks that every #include "..." of the library, the benchmarks and the Python binding points
down the floors of docs/development.md ("Layers"), and that no two top-level folders include each
other, directly or through others. Exit 0 when the layout holds; else one line per upward edge or
cycle and exit 1.

    scripts/check_layers.py [REPO]      (default: the repository holding this script)

A file's folder: src/<folder>/... (its cuda/ sub-folder included), bench/, python/src/, or, for a
public header include/moefq/<name>.h (or include/moefq/numerics/*.h), the folder that implements
it (PUBLIC_HEADERS). A file may
include its own folder and any folder on a lower floor; a folder beside it on the same floor, or
above it, is an error. Third-party and system headers (<...>) and the binding's own files are
not checked.
"""

import os
import re
import sys

# Floors, lowest first. A folder may include only its own files and those of lower floors.
FLOORS = [
    ["numerics", "errors"],   # the formats' scalar rules (numerics.h, numerics/*.h); the error type
    ["metrics", "io", "cuda_base"],  # error metrics; files and host memory; the CUDA helpers every kernel uses
    ["quant", "dist"],        # QDQ, quantizers, recipes (+ their kernels); the ranks' environment
    ["engine"],               # the MoE layer on CPU and GPU: config, router, GEMMs, buffers, weights
    ["comm"],                 # real ranks over NCCL (implements the engine's RankLink)
    ["fakequant"],            # the fake-quantized layer, its back-end registry, the public CUDA face
    ["eval"],                 # moefq eval / calibrate: runners, memory plan, metrics reductions
    ["report"],               # JSON, CSV, HTML reports of an eval
    ["tool"],                 # what the moefq tool's commands and benchmarks share
    ["bench", "python"],      # the benchmark programs; the Python binding
    ["cli"],                  # the moefq tool
]

# Each public header (include/moefq/) belongs to the folder that implements it.
PUBLIC_HEADERS = {
    "numerics": ["numerics.h", "numerics"],  # numerics/: the umbrella's headers, one per job
    "errors": ["errors.h"],
    "metrics": ["metrics.h"],
    "io": ["fileio.h", "host_memory.h", "safetensors.h"],
    "cuda_base": ["cuda_device.h"],
    "quant": ["calibration_file.h", "calibration_stats.h", "qdq.h", "quant_spec.h", "quantizer.h", "recipe.h",
              "wire_bytes.h"],
    "dist": ["dist_env.h"],
    "engine": ["buffer_layout.h", "checkpoint.h", "cpu_engine.h", "moe_config.h", "router.h", "synthetic.h",
               "weight_cache.h", "weights.h"],
    "fakequant": ["combine_qdq.h", "cuda.h", "expert_backend.h", "fake_quant_moe.h", "moe_quantizers.h"],
    "eval": ["eval.h", "link_model.h"],
    "report": ["report.h"],
}

SOURCE_EXT = (".h", ".cuh", ".cpp", ".cu")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def main() -> int:
    repo = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    floor = {f: i for i, names in enumerate(FLOORS) for f in names}
    public = {h: folder for folder, hs in PUBLIC_HEADERS.items() for h in hs}
    errors = []

    def folder_of(path: str):
        """The folder of a repository path, or None for what is not checked."""
        parts = path.split("/")
        if parts[0] == "src" and len(parts) > 2:
            return parts[1]
        if parts[0] == "bench":
            return "bench"
        if parts[:2] == ["python", "src"]:
            return "python"
        if parts[:2] == ["include", "moefq"]:
            name = parts[2]
            if name not in public:
                errors.append(f"{path}: a public header without a folder: add it to PUBLIC_HEADERS "
                              "(and to docs/development.md's map)")
                return None
            return public[name]
        return None

    def target_of(src_path: str, inc: str):
        """The repository path an include names, or None (the binding's own files, not found)."""
        if inc.startswith("moefq/"):
            return "include/" + inc
        for candidate in ("src/" + inc, inc):  # src/ and the repository root are on the include path
            if os.path.exists(os.path.join(repo, candidate)):
                return candidate
        return None

    edges = {}  # folder -> {folder: an example "file -> include"}
    for top in ("src", "bench", "python/src", "include/moefq"):
        for dirpath, _, files in os.walk(os.path.join(repo, top)):
            for name in sorted(files):
                if not name.endswith(SOURCE_EXT):
                    continue
                path = os.path.relpath(os.path.join(dirpath, name), repo)
                src = folder_of(path)
                if src is None:
                    continue
                if src not in floor:
                    errors.append(f"{path}: folder '{src}' has no floor: add it to FLOORS (and to docs/development.md)")
                    continue
                with open(os.path.join(repo, path), encoding="utf-8") as f:
                    text = f.read()
                for inc in INCLUDE.findall(text):
                    target = target_of(path, inc)
                    dst = folder_of(target) if target else None
                    if dst is None or dst == src:
                        continue
                    if dst not in floor:
                        errors.append(f"{path}: includes {inc} of folder '{dst}', which has no floor")
                        continue
                    edges.setdefault(src, {}).setdefault(dst, f"{path} -> {inc}")
                    if floor[dst] >= floor[src]:
                        where = "beside" if floor[dst] == floor[src] else "above"
                        errors.append(f"{path}: includes {inc}: '{dst}' is {where} '{src}' (floor {floor[dst]} vs "
                                      f"{floor[src]})")

    # Cycles between folders (none can pass the floor check; this says so independently of FLOORS).
    state, stack = {}, []

    def visit(node: str):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                errors.append("folder cycle: " + " -> ".join(cycle))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)

    for e in errors:
        print(e)
    if not errors:
        n = sum(len(v) for v in edges.values())
        print(f"layers ok: {len(edges)} folders, {n} folder-to-folder edges, all pointing down, no cycle")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

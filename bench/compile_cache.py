"""
A portable compile cache per compiled configuration, so that a GPU lease compiles each configuration once and not on
every lease: torch.compiler.save_cache_artifacts() (every artifact this process's compiles made or loaded: inductor's
graphs and kernels, AOT autograd's graphs, autotuning results) written to one file after the warm-up steps, and
torch.compiler.load_cache_artifacts() of that file before the next process's first compile, which then finds its
compiles in inductor's own caches. `bench train --compile-cache FILE` and bench/reference_train.py do both; any other
module runs under it as

    python -m bench.compile_cache FILE -m scripts.base_train --depth=12 ...   # loads FILE first, saves it at exit

and gpu_check --suite packs a folder of such files into one archive a lease can carry (pack, unpack). Only torch and
the standard library: bench/reference_train.py, which must not import our packages, loads this module by its file.
"""

import gzip
import os
import runpy
import sys
import tarfile
import tempfile
import time

import torch


def load(path):
    """Hot-load the artifacts in `path`, if there is such a file, before anything compiles. Returns what a result
    records: compile_cache "warm" (a file was loaded) or "cold", and the file's size and artifact count."""
    if not path or not os.path.isfile(path):
        return {"compile_cache": "cold", "compile_cache_file": path or None}
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        data = f.read()
    info = torch.compiler.load_cache_artifacts(data)
    artifacts = sum(len(keys) for keys in info.artifacts.values()) if info is not None else 0
    return {"compile_cache": "warm" if artifacts else "cold", "compile_cache_file": path,
            "compile_cache_bytes": len(data), "compile_cache_artifacts": artifacts,
            "compile_cache_load_s": time.perf_counter() - t0}


def save(path):
    """Write this process's compile artifacts to `path` (a temporary file renamed over it: a process killed while
    writing never leaves half a cache for the next one to load). Returns the bytes written, 0 when nothing was
    compiled (an eager run, or a backend with no cache such as aot_eager)."""
    if not path:
        return 0
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        return 0
    data = saved[0]
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return len(data)


def compile_counts():
    """What torch.compile did in this process so far, from dynamo's counters: graph breaks, frames compiled, graphs,
    and the hits and misses of inductor's graph cache and AOT autograd's cache (a warm start hits, a cold one misses)."""
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {"graph_breaks": sum(counters["graph_break"].values()), "frames_compiled": counters["frames"]["ok"],
            "unique_graphs": counters["stats"]["unique_graphs"], "fxgraph_cache_hit": inductor["fxgraph_cache_hit"],
            "fxgraph_cache_miss": inductor["fxgraph_cache_miss"], "autograd_cache_hit": aot["autograd_cache_hit"],
            "autograd_cache_miss": aot["autograd_cache_miss"]}


def after_first_step(counts_then):
    """compile_counts() now, with `recompiles`: the frames compiled since `counts_then` (taken after the first step,
    which compiles everything a step needs: any later compile is a recompile, which a timed step must not have)."""
    now = compile_counts()
    return {**now, "recompiles": now["frames_compiled"] - counts_then["frames_compiled"]}


# -----------------------------------------------------------------------------
# One archive for a lease to carry: the per-configuration files of a folder


def pack(paths, archive, limit_bytes):
    """The files in `paths` (the most wanted first) into the gzipped tar `archive`, each under its base name, as many
    as keep the archive under `limit_bytes` (what a lease's output folder returns). Returns (packed, left_out) names."""
    packed, left_out, size = [], [], 1024  # the tar's end blocks
    for path in paths:
        with open(path, "rb") as f:
            compressed = len(gzip.compress(f.read(), compresslevel=6)) + 512  # + its tar header
        if size + compressed < limit_bytes:
            packed.append(path)
            size += compressed
        else:
            left_out.append(os.path.basename(path))
    tmp = archive + ".tmp"
    with tarfile.open(tmp, mode="w:gz", compresslevel=6) as tar:
        for path in packed:
            tar.add(path, arcname=os.path.basename(path))
    os.replace(tmp, archive)
    return [os.path.basename(p) for p in packed], left_out


def unpack(archive, folder):
    """The regular files of `archive` into `folder`, each under its base name (an archive cannot write elsewhere),
    except where `folder` already holds a newer file of that name (a later command on the same machine must not put
    back the older caches it started from). Returns the names unpacked."""
    os.makedirs(folder, exist_ok=True)
    names, carried_at = [], os.path.getmtime(archive)
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            target = os.path.join(folder, os.path.basename(member.name))
            if not member.isfile() or (os.path.exists(target) and os.path.getmtime(target) > carried_at):
                continue
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                dst.write(src.read())
            names.append(os.path.basename(member.name))
    return names


def main(argv):
    """python -m bench.compile_cache FILE -m MODULE ARGS...: MODULE run as `python -m` would, with FILE loaded before
    and this process's compile artifacts saved to it when the module ends (a clean exit or sys.exit)."""
    usage = "usage: python -m bench.compile_cache FILE -m MODULE [ARGS...]"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{main.__doc__.split(':', 1)[1].strip()}")
        return
    if len(argv) < 3 or argv[1] != "-m":
        sys.exit(usage)
    path, module = argv[0], argv[2]
    loaded = load(path)
    print(f"compile cache: {loaded['compile_cache']} ({path})", file=sys.stderr)
    sys.argv = [module, *argv[3:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        written = save(path)
        print(f"compile cache: {written:,} bytes saved to {path}" if written else "compile cache: nothing compiled",
              file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])

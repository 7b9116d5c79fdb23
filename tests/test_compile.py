"""Build checks of the one kernel source, without running anything on a GPU.

- The ABI: the table the CPU build exports (commref_abi_table(), cpu/abi.cpp: every
  struct size, alignment, field offset, size and signedness, every constant and code,
  every kernel) equals device_kernels/abi.py's abi.abi_table(), built from its own
  dtypes and constants (test_abi_table_matches_python); the kernels the library
  defines are exactly abi.KERNEL_NAMES and abi.ENGINE_KERNEL_NAMES.
- Every kernel compiles for sm_90: with nvcc (gpu_loader.nvcc_compile_check) when nvcc is
  on PATH, else with the GPU loader's NVRTC (CuPy's bindings); skipped only when
  neither exists. The modules are the GPU
  loader's per-(dtype, op) specialisations of every kernel file (see gpu_modules()
  for which, and COMMREF_TEST_ALL_GPU_MODULES=1 for all of them plus the full build).
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from commref.collectives.catalogue import CATALOGUE
from commref.collectives.launch_record import HostWords
from commref.device_kernels import abi, build, cpu_loader, gpu_loader

ARCH = "sm_90"


# ---- ABI ----


def abi_diff(python: dict, cxx: dict) -> list[str]:
    """The entries on which the two tables differ, one line each."""
    lines = []
    for key in sorted(set(python) | set(cxx)):
        if key not in cxx:
            lines.append(f"  {key}: {python[key]!r} in abi.py, missing in C++ (cpu/abi.cpp, include/commref/)")
        elif key not in python:
            lines.append(f"  {key}: {cxx[key]!r} in C++, missing in abi.py")
        elif python[key] != cxx[key]:
            lines.append(f"  {key}: {python[key]!r} in abi.py, {cxx[key]!r} in C++")
    return lines


@pytest.fixture(scope="module")
def cxx_table() -> dict:
    return cpu_loader.cpu_kernels().abi_table()


def test_abi_table_matches_python(cxx_table):
    """The one reflection test: every struct, field, constant, code and kernel name of
    abi.py equals its C++ twin, and neither side has an entry the other lacks."""
    python = abi.abi_table()
    diff = abi_diff(python, cxx_table)
    assert not diff, f"{len(diff)} ABI entries differ between abi.py and the C++ headers:\n" + "\n".join(diff)
    print(f"ABI: {len(python)} entries match")


def test_abi_table_covers_the_abi(cxx_table):
    """The table is not vacuous: every struct field, every code table and every
    constant kind is in it."""
    for name, dt in abi.STRUCTS.items():
        assert f"sizeof({name})" in cxx_table
        for field in dt.names:
            assert f"offsetof({name}, {field})" in cxx_table, (name, field)
    for prefix in (
        "DTYPE_CODES.",
        "CXX_TYPES.",
        "OP_CODES.",
        "COLLECTIVE_CODES.",
        "ALGORITHM_CODES.",
        "GIN_PROTOCOLS.",
        "CALL_FIELDS.",
        "kernel(",
    ):
        assert any(k.startswith(prefix) for k in cxx_table), prefix
    for name in (
        "MAX_CHANNELS",
        "SLOT_HEADER",
        "FLAG_STRIDE",
        "GIN_QUEUE_CONSUMED",
        "GIN_QUEUE_IDLE",
        "GIN_QUEUE_HELP_FN",
        "GIN_QUEUE_HELP_CTX",
        "GIN_QUEUE_HELP_END",
        "GIN_QUEUE_HEADER",
        "LAUNCH_REFUSED",
        "WAIT_LSA_BARRIER",
        "GIN_HAS_COUNTER",
        "ERR_ABORTED",
        "IN_TREE_PARENT",
    ):
        assert name in cxx_table, name


def test_abi_diff_names_a_planted_mismatch(cxx_table, monkeypatch):
    """abi_table() follows the definitions: a changed constant and a field added on the
    Python side only both show up, by name."""
    monkeypatch.setattr(abi, "FLAG_STRIDE", abi.FLAG_STRIDE * 2)
    grown = np.dtype(abi.COPY_ARGS.descr + [("extra", "<u8")], align=True)
    monkeypatch.setitem(abi.STRUCTS, "CopyArgs", grown)
    monkeypatch.setattr(abi, "COPY_ARGS", grown)
    diff = "\n".join(abi_diff(abi.abi_table(), cxx_table))
    assert "FLAG_STRIDE: 128 in abi.py, 64 in C++" in diff
    assert "offsetof(CopyArgs, extra): 24 in abi.py, missing in C++" in diff
    assert "sizeof(CopyArgs): 32 in abi.py, 24 in C++" in diff


def test_kernel_names_are_the_library_kernels(cxx_table):
    """abi.KERNEL_NAMES and abi.ENGINE_KERNEL_NAMES are exactly the kernels the library
    exports (each COMMREF_KERNEL registers itself), each defined in one kernel file,
    and each resolvable as a symbol."""
    kernels = cpu_loader.cpu_kernels()
    registered = {k[len("kernel(") : -1] for k in cxx_table if k.startswith("kernel(")}
    named = set(abi.KERNEL_NAMES) | set(abi.ENGINE_KERNEL_NAMES)
    assert len(named) == len(abi.KERNEL_NAMES) + len(abi.ENGINE_KERNEL_NAMES), "a kernel name is listed twice"
    assert registered - named == set(), f"the library exports kernels that abi.py does not name: {registered - named}"
    assert named - registered == set(), f"abi.py names kernels the library does not export: {named - registered}"
    assert set(build.kernel_files()) == named, "the COMMREF_KERNEL lines of kernels/*.cu differ from abi.py"
    for name in sorted(named):
        assert kernels.entry(name), name
    assert set(build.gpu_sources()) == {build.kernel_files()[n] for n in abi.KERNEL_NAMES}


def test_abi_numpy_dtypes_are_c_layouts():
    """abi.py's dtypes are aligned like C structs (so a record's bytes are the struct),
    without implicit padding (explicit pad fields, as cpu/abi.cpp asserts for C++)."""
    for name, dt in abi.STRUCTS.items():
        assert dt.isalignedstruct, f"{name} is not an aligned struct dtype"
        end = 0
        for field in dt.names:
            sub, off = dt.fields[field][:2]
            assert off == end, f"{name}.{field} at {off}: implicit padding after {end}"
            end = off + sub.itemsize
        assert end == dt.itemsize, f"{name}: implicit padding at the end"
        assert dt.itemsize % dt.alignment == 0, name
        args = np.zeros(1, dtype=dt)
        assert args.nbytes == dt.itemsize
    assert abi.COLL_ARGS.fields["layout"][0] == abi.WINDOW_LAYOUT
    assert abi.COLL_ARGS.fields["peers"][0].shape == (abi.MAX_CHANNELS,)
    assert abi.COLL_ARGS.fields["peers"][0].base == abi.CHANNEL_PEERS


def test_call_descriptor_fields():
    """CALL_FIELDS are disjoint and inside 64 bits; pack_call and unpack_call invert."""
    used = 0
    for name, shift, bits in abi.CALL_FIELDS:
        mask = ((1 << bits) - 1) << shift
        assert mask < 1 << 64 and used & mask == 0, name
        used |= mask
    desc = abi.pack_call("broadcast", "ring", abi.DTYPE_CODES["bfloat16"], abi.OP_CODES["avg"], 513, 7, "ll128")
    assert abi.unpack_call(desc) == {
        "collective": "broadcast",
        "algorithm": "ring",
        "dtype": "bfloat16",
        "op": "avg",
        "root": 513,
        "nchannels": 7,
        "protocol": "ll128",
        "variant": 0,
    }
    simple = abi.pack_call("broadcast", "ring", abi.DTYPE_CODES["bfloat16"], abi.OP_CODES["avg"], 513, 7)
    assert abi.unpack_call(simple)["protocol"] == "simple" and simple != desc  # ranks that disagree differ
    one, two = (abi.pack_call("allreduce", "nvls", 7, 0, 0, 2, variant=v) for v in ("one_shot", "two_shot"))
    assert abi.unpack_call(two)["variant"] == abi.NVLS_VARIANTS["two_shot"] == 1 and one != two


def test_wait_what_describes_every_wait_code():
    codes = {
        abi.WAIT_RECV_READY,
        abi.WAIT_SEND_CREDIT,
        abi.CALL_MISMATCH,
        abi.COUNT_MISMATCH,
        abi.WAIT_GIN_QUEUE,
        abi.WAIT_GIN_FLUSH,
        abi.WAIT_LSA_BARRIER,
        abi.BUFFER_MISMATCH,
        abi.WAIT_SIGNAL,
        abi.WAIT_COUNTER,
        abi.WAIT_BARRIER,
        abi.BAD_ARGUMENT,
        abi.WAIT_P2P_ACCEPT,
        abi.P2P_RECV_MISMATCH,
        abi.P2P_SEND_REJECTED,
    }
    assert set(abi.WAIT_WHAT) == codes


# ---- GPU compile (no GPU needed) ----


def nvrtc_available() -> str | None:
    """None when the loader can compile with NVRTC (CuPy's bindings), else why not."""
    try:
        gpu_loader._nvrtc()
        return None
    except build.KernelError as e:
        return str(e)


def nvcc_with_size_probe(tmp_path: Path) -> tuple[str, Path]:
    """A wrapper around nvcc that records the size of each cubin it wrote, one line per
    call, so that the loader's own command lines (which write into a temporary folder)
    can be measured."""
    real = shutil.which("nvcc")
    size_file = tmp_path / "cubin_sizes"
    wrapper = tmp_path / "nvcc"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"'{real}' \"$@\"\nrc=$?\n"
        'out=\nprev=\nfor a in "$@"; do [ "$prev" = -o ] && out=$a; prev=$a; done\n'
        f'[ -f "$out" ] && wc -c < "$out" >> \'{size_file}\'\n'
        "exit $rc\n"
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper), size_file


def gpu_modules() -> dict[str, tuple[str, ...]]:
    """The modules to compile, by name.

    The GPU loader compiles one module per (kernel file, specialization)
    (gpu_loader.specialization()); each case here compiles the kernel files with one
    specialization's defines. By default: the data-movement module, every dtype with
    sum (type-specific code: conversions, Arith, Unsigned) and float32 with every other
    functor (op-specific code) -- 14 cases. Each goes through ptxas (registers, stack,
    spills: check_frames), except the dtypes of PTX_ONLY, whose cases stop at PTX: their
    code is the same templates at another type, which the front end and NVVM check
    whole, while the 4-byte and 8-byte instances (float32, float64, uint64) carry the
    register pressure ptxas is asked about. With COMMREF_TEST_ALL_GPU_MODULES=1: every
    case through ptxas, all of gpu_loader.all_specializations() and the full build (no
    defines: every kernel with every instance, what nvcc_compile_check() builds by
    default; minutes of ptxas on a small machine).
    """
    dtype_names = {v: k for k, v in abi.DTYPE_CODES.items()}
    op_names = {v: k for k, v in abi.OP_CODES.items() if k != "avg"}  # avg shares sum's module
    everything = os.environ.get("COMMREF_TEST_ALL_GPU_MODULES", "") not in ("", "0")
    specs: dict[str, tuple[str, ...]] = {"data-movement": gpu_loader.specialization(None)}
    for dtype in sorted(dtype_names):
        for op in sorted(op_names):
            if everything or op == abi.OP_CODES["sum"] or dtype == abi.DTYPE_CODES["float32"]:
                specs[f"{dtype_names[dtype]}-{op_names[op]}"] = gpu_loader.specialization((dtype, op))
    if everything:
        assert sorted(set(specs.values())) == sorted(gpu_loader.all_specializations())
        specs["full"] = ()
    return specs


GPU_MODULES = gpu_modules()
EVERY_MODULE = os.environ.get("COMMREF_TEST_ALL_GPU_MODULES", "") not in ("", "0")
PTX_ONLY = () if EVERY_MODULE else ("float16", "bfloat16", "int8", "uint8", "int32", "uint32", "int64")


def test_reduction_sources_are_the_files_of_the_reducing_kernels():
    """The reduction modules' compile cases skip the other files: build.reduction_sources
    holds every file with a reducing collective's kernel, and no other file dispatches
    on (dtype, op)."""
    where = build.kernel_files()
    reducing = {where[k] for c in CATALOGUE.values() if c.reducing for k in c.kernels.values()}
    assert set(build.reduction_sources()) == reducing
    for f in set(build.kernel_sources()) - reducing:
        assert "COMMREF_ONLY_" not in f.read_text() and "COMMREF_INSTANCES" not in f.read_text(), f


@pytest.mark.parametrize("which", list(GPU_MODULES))
def test_every_kernel_compiles_for_sm90(which, tmp_path):
    defines = GPU_MODULES[which]
    # A reduction module's defines change only the files that dispatch on (dtype, op);
    # the others compile to the same code as in the data-movement case.
    sources = build.reduction_sources() if defines and which != "data-movement" else build.kernel_sources()
    output = "ptx" if which.split("-")[0] in PTX_ONLY else "cubin"
    t0 = time.perf_counter()
    if shutil.which("nvcc"):
        nvcc, size_file = nvcc_with_size_probe(tmp_path)
        kwargs = {"defines": defines} if defines else {}
        flags = ("-Xptxas", "-v") if output == "cubin" else ()
        proc = gpu_loader.nvcc_compile_check(ARCH, nvcc=nvcc, flags=flags, sources=sources, output=output, **kwargs)
        elapsed = time.perf_counter() - t0
        assert proc.returncode == 0, f"nvcc failed for {ARCH} ({which}: {defines}):\n{proc.stderr[-6000:]}"
        sizes = [int(x) for x in size_file.read_text().split()] if size_file.exists() else []
        assert len(sizes) == len(sources) and all(sizes), (
            f"nvcc reported success but wrote {output} files of sizes {sizes} for {len(sources)} files"
        )
        size = sum(sizes)
        print(f"nvcc {ARCH} {which}: {len(sizes)} {output}, {size} bytes ({size / 2**20:.2f} MiB) in {elapsed:.1f} s")
        if output == "cubin":
            check_frames(ptxas_resources(proc.stdout + proc.stderr), which, sources)
        return
    why = nvrtc_available()
    if why is not None:
        pytest.skip(f"neither nvcc nor NVRTC is available: {why}")
    target = f"--gpu-architecture={ARCH}"
    size = sum(len(gpu_loader.compile_gpu_image(path, defines, target, "cubin")) for path in sources)
    elapsed = time.perf_counter() - t0
    version = gpu_loader.nvrtc_version()
    print(f"NVRTC {version} {ARCH} {which}: {size} bytes ({size / 2**20:.2f} MiB) in {elapsed:.1f} s")


# ---- GPU resources and the failure path ----

# Bytes per thread; measured 544 with the LL and LL128 paths (CUDA 13, sm_90), 1248 before __grid_constant__.
RING_STACK_BOUND = 640


def ptxas_resources(log: str) -> dict[str, dict[str, int]]:
    """Per entry function of `ptxas -v` output: registers, stack (frame bytes),
    cumulative stack, spill stores and spill loads."""
    import re

    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = out.setdefault(m.group(1), {})
            continue
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            current = out.get(m.group(1))  # None for device functions: not an entry
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes cumulative stack size", line)
        if m:
            current["registers"], current["cumulative_stack"] = map(int, m.groups())
    return out


def check_frames(found: dict[str, dict[str, int]], which: str, sources=None) -> None:
    """Every kernel of build.kernel_files() (of the files `sources`; None: all) in ptxas'
    figures `found`: no spills, and a stack (frame and cumulative) within
    gpu_loader.STACK_BYTES, the limit CudaKernels sets on each device before any kernel
    runs (so no launch makes the driver grow local memory)."""
    kernels = sorted(n for n, f in build.kernel_files().items() if sources is None or f in sources)
    missing = sorted(set(kernels) - set(found))
    assert not missing, f"{which}: ptxas reported no figures for {missing}"
    for name in kernels:
        r = found[name]
        print(
            f"  {name}: {r.get('registers', 0)} registers, {r['stack']} bytes stack, "
            f"spills {r['spill_stores']} stored / {r['spill_loads']} loaded"
        )
    spilled = {
        n: (r["spill_stores"], r["spill_loads"]) for n, r in found.items() if r["spill_stores"] or r["spill_loads"]
    }
    assert not spilled, f"{which}: kernels spill (stores, loads): {spilled}"
    limit = gpu_loader.STACK_BYTES
    deep = {n: r["stack"] for n, r in found.items() if max(r["stack"], r.get("cumulative_stack", 0)) > limit}
    assert not deep, f"{which}: stack frames above gpu_loader.STACK_BYTES ({gpu_loader.STACK_BYTES}): {deep}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (a compile check, nothing runs)")
def test_users_kernels_fit_the_stack_limit_without_spills(tmp_path):
    """The device API's own kernels (kernels/device_api/: the MoE kernels) and the
    examples (examples/: RMSNorm), as ptxas sees them for sm_90: no spill, and frames
    within gpu_loader.STACK_BYTES, the limit set on the device before any kernel runs."""
    from helpers import nvcc_sm90

    sources = sorted((build.KERNEL_DIR / "device_api").glob("*.cu")) + sorted(
        (build.SOURCE_DIR / "examples").glob("*.cu")
    )
    assert sources
    for src in sources:
        proc = nvcc_sm90(src, tmp_path / f"{src.stem}.cubin", timeout=300, flags=("-Xptxas", "-v"))
        assert proc.returncode == 0, f"{src.name}:\n{proc.stderr[-4000:]}"
        found = ptxas_resources(proc.stdout + proc.stderr)
        assert found, f"{src.name}: ptxas reported no entry function"
        for name, r in found.items():
            print(f"  {src.name} {name}: {r['stack']} bytes stack, spills {r['spill_stores']} / {r['spill_loads']}")
            assert r["spill_stores"] == r["spill_loads"] == 0, (src.name, name, r)
            assert max(r["stack"], r.get("cumulative_stack", 0)) <= gpu_loader.STACK_BYTES, (src.name, name, r)


def test_frame_check_can_fail():
    """check_frames refuses a spill and a frame above the limit."""
    ok = {n: {"stack": 544, "cumulative_stack": 544, "spill_stores": 0, "spill_loads": 0} for n in build.kernel_files()}
    check_frames(ok, "planted")
    name = next(iter(ok))
    with pytest.raises(AssertionError, match="spill"):
        check_frames({**ok, name: dict(ok[name], spill_stores=8)}, "planted")
    with pytest.raises(AssertionError, match="above gpu_loader.STACK_BYTES"):
        check_frames({**ok, name: dict(ok[name], stack=gpu_loader.STACK_BYTES + 8)}, "planted")


def test_ring_kernels_stack_stays_small(tmp_path):
    """Every ring kernel of the float32-sum module, compiled by nvcc for sm_90, keeps
    its per-thread stack under RING_STACK_BOUND: the launch arguments are read in place
    (__grid_constant__), not copied to local memory by every thread, and the launch
    bounds do not force spills."""
    import subprocess

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not available")
    ring = build.kernel_files()["commref_ring_allreduce"]
    defines = gpu_loader.specialization((abi.DTYPE_CODES["float32"], abi.OP_CODES["sum"]))
    cmd = [
        nvcc,
        f"-arch={ARCH}",
        "-std=c++17",
        "-cubin",
        "-Xptxas",
        "-v",
        "-I",
        str(build.INCLUDE_DIR),
        *(f"-D{d}" for d in defines),
        "-o",
        str(tmp_path / "ring.cubin"),
        str(ring),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nvcc failed:\n{proc.stderr[-6000:]}"
    found = ptxas_resources(proc.stdout + proc.stderr)
    ring_kernels = sorted(n for n, f in build.kernel_files().items() if f == ring)
    assert ring_kernels and sorted(found) == ring_kernels, (sorted(found), ring_kernels)
    for name in ring_kernels:
        r = found[name]
        print(
            f"{name}: {r['registers']} registers, {r['stack']} bytes stack ({r['cumulative_stack']} cumulative), "
            f"spills {r['spill_stores']} stored / {r['spill_loads']} loaded"
        )
    too_big = {
        n: (found[n]["stack"], found[n]["cumulative_stack"])
        for n in ring_kernels
        if max(found[n]["stack"], found[n]["cumulative_stack"]) >= RING_STACK_BOUND
    }
    assert not too_big, f"ring kernels' stack (frame, cumulative) at or above {RING_STACK_BOUND} bytes: {too_big}"


def test_kernels_never_trap(tmp_path):
    """No kernel file compiles a trap: a failing kernel records the
    error and its blocks return (wait.h), so the CUDA context stays usable."""
    import concurrent.futures
    import subprocess

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not available")
    defines = gpu_loader.specialization((abi.DTYPE_CODES["float32"], abi.OP_CODES["sum"]))

    def ptx(src: Path) -> tuple[Path, subprocess.CompletedProcess]:
        out = tmp_path / f"{src.stem}.ptx"
        cmd = [
            nvcc,
            f"-arch={ARCH}",
            "-std=c++17",
            "-ptx",
            "-I",
            str(build.INCLUDE_DIR),
            *(f"-D{d}" for d in defines),
            "-o",
            str(out),
            str(src),
        ]
        return out, subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    sources = build.kernel_sources()
    with concurrent.futures.ThreadPoolExecutor(len(sources)) as pool:
        results = list(pool.map(ptx, sources))
    for (out, proc), src in zip(results, sources):
        assert proc.returncode == 0, f"nvcc -ptx failed for {src.name}:\n{proc.stderr[-6000:]}"
        text = out.read_text()
        assert "trap;" not in text, f"{src.name} compiles a trap"
    assert any("exit;" in out.read_text() for out, _ in results), "no kernel leaves through exit on failure"


def _no_instance_launch(kernels, name: str, dtype: int, op: int) -> np.ndarray:
    record = np.zeros(1, dtype=abi.ERROR_RECORD)
    args = np.zeros(1, dtype=abi.COLL_ARGS)
    args["errorRecord"] = record.ctypes.data
    args["rank"], args["nranks"], args["nchannels"] = 3, 4, 2
    args["dtype"], args["op"] = dtype, op
    assert kernels.launch(name, 2, 4, args) == abi.LAUNCH_FAILED, name
    return record[0]


def test_reduction_kernel_without_the_instance_records_why():
    """A reduction kernel launched with a (dtype, op) it has no instance for records
    ERR_NO_INSTANCE (seen: the call's dtype | op << 32; expected: what the build holds,
    all ones for the full build) and fails the launch, instead of ending silently."""
    kernels = cpu_loader.cpu_kernels()
    for name in ("commref_ring_allreduce", "commref_tree_allreduce", "commref_direct_allreduce"):
        e = _no_instance_launch(kernels, name, 99, abi.OP_CODES["max"])
        assert int(e["code"]) == abi.ERR_NO_INSTANCE, (name, e)
        assert int(e["seen"]) == 99 | abi.OP_CODES["max"] << 32 and int(e["expected"]) == 2**64 - 1, (name, e)
        assert (int(e["rank"]), int(e["peer"])) == (3, -1) and int(e["channel"]) in (0, 1), (name, e)
        host = HostWords(np.zeros(1, np.uint64), "cpu")
        host.error[0] = e
        exc = host.failure(3, 1.0)
        assert isinstance(exc, build.KernelError), exc
        assert str(exc) == "rank 3: the kernel has no instance for dtype #99 with max; it holds every instance"
        e = _no_instance_launch(kernels, name, abi.DTYPE_CODES["float32"], 77)
        assert int(e["code"]) == abi.ERR_NO_INSTANCE and int(e["seen"]) == abi.DTYPE_CODES["float32"] | 77 << 32

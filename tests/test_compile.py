"""Build checks of the one kernel source, without running anything on a GPU.

- Every kernel compiles for sm_90: with nvcc (loader.nvcc_compile_check) when nvcc is
  on PATH, else with NVRTC through cuda-python (cuda.bindings.nvrtc) or CuPy when one
  is importable; skipped only when none of them exists. The modules are the GPU
  loader's per-(dtype, op) specialisations (see gpu_modules() for which, and
  COMMREF_TEST_ALL_GPU_MODULES=1 for all of them plus the full module).
- The launch ABI: every size and offset that the CPU build reports (commref_abi_*())
  equals device_kernels/abi.py's numpy dtypes.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from commref.device_kernels import abi, loader

ARCH = "sm_90"


# ---- ABI ----

def test_abi_sizes_and_offsets_match_numpy():
    layout = loader.cpu_kernels().abi()
    assert layout, "the CPU build reports no ABI entries"
    checked_sizes, checked_fields = set(), []
    for key, value in layout.items():
        struct, _, field = key.partition(".")
        assert struct in abi.STRUCTS, f"the C build lists {key!r}, but abi.py has no dtype for {struct}"
        dt = abi.STRUCTS[struct]
        if field:
            assert field in dt.fields, f"abi.py's {struct} has no field {field!r} (the C build lists {key})"
            offset = dt.fields[field][1]
            assert offset == value, f"offsetof({key}) is {value} in C, {offset} in abi.py"
            checked_fields.append(key)
        else:
            assert dt.itemsize == value, f"sizeof({struct}) is {value} in C, {dt.itemsize} in abi.py"
            checked_sizes.add(struct)
    assert checked_sizes == set(abi.STRUCTS), f"sizes reported for {sorted(checked_sizes)} only"
    # Every field the C build lists, for every struct with fields listed.
    assert {"CollArgs", "WindowLayout", "ChannelPeers", "ErrorRecord"} <= {k.split(".")[0] for k in checked_fields}
    # Nested records and arrays keep the C shapes.
    assert abi.COLL_ARGS.fields["layout"][0] == abi.WINDOW_LAYOUT
    assert abi.COLL_ARGS.fields["peers"][0].shape == (abi.MAX_CHANNELS,)
    assert abi.COLL_ARGS.fields["peers"][0].base == abi.CHANNEL_PEERS
    print(f"ABI: {len(checked_sizes)} struct sizes and {len(checked_fields)} field offsets match")


def test_abi_numpy_dtypes_are_c_layouts():
    """abi.py's dtypes are aligned like C structs (so a record's bytes are the struct)."""
    for name, dt in abi.STRUCTS.items():
        assert dt.isalignedstruct, f"{name} is not an aligned struct dtype"
        ends = [off + sub.itemsize for sub, off, *_ in dt.fields.values()]
        assert max(ends) <= dt.itemsize, name
        assert dt.itemsize % dt.alignment == 0, name
        args = np.zeros(1, dtype=dt)
        assert args.nbytes == dt.itemsize


# ---- GPU compile (no GPU needed) ----

def nvrtc_backend() -> tuple[tuple[str, object] | None, list[str]]:
    """(('cuda-python' | 'cupy', module) or None, why each candidate is unusable)."""
    why = []
    for modname in ("cuda.bindings.nvrtc", "cuda.nvrtc"):
        try:
            mod = __import__(modname, fromlist=["nvrtcCreateProgram"])
            err, _major, _minor = mod.nvrtcVersion()  # loads libnvrtc: fails if it is missing
            if _ok(mod, err):
                return ("cuda-python", mod), why
            why.append(f"{modname}: nvrtcVersion() returned {err}")
        except Exception as e:  # noqa: BLE001 - not importable or no libnvrtc: try the next
            why.append(f"{modname}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    try:
        from cupy.cuda import compiler

        compiler._get_nvrtc_version()
        return ("cupy", compiler), why
    except Exception as e:  # noqa: BLE001
        why.append(f"cupy: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return None, why


def _ok(nvrtc, err) -> bool:
    return err == nvrtc.nvrtcResult.NVRTC_SUCCESS


def nvrtc_options(defines: tuple[str, ...]) -> list[str]:
    """The loader's NVRTC options (CudaKernels.module) for one specialization."""
    return [*loader.NVRTC_OPTIONS, f"-I{loader.INCLUDE_DIR}", f"-I{loader.SOURCE_DIR / 'kernels'}",
            *(f"-D{d}" for d in defines)]


def compile_cuda_python(nvrtc, defines: tuple[str, ...]) -> tuple[int, str]:
    """Compiles to an sm_90 cubin with cuda-python's NVRTC; returns (size, log)."""
    err, prog = nvrtc.nvrtcCreateProgram(loader.gpu_source().encode(), b"all.cu", 0, [], [])
    assert _ok(nvrtc, err), err
    try:
        opts = [o.encode() for o in (*nvrtc_options(defines), f"--gpu-architecture={ARCH}")]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, log_size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * log_size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.decode(errors="replace").rstrip("\x00 \n")
        assert _ok(nvrtc, err), f"NVRTC failed ({err}):\n{log_text[-6000:]}"
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        assert _ok(nvrtc, err), err
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        assert _ok(nvrtc, err), err
        assert size > 0 and cubin[:4] == b"\x7fELF", "NVRTC returned no sm_90 cubin"
        return size, log_text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_cupy(compiler, defines: tuple[str, ...]) -> tuple[int, str]:
    """Compiles with CuPy's NVRTC wrapper for sm_90 (a cubin, or PTX where this NVRTC
    cannot emit an sm_90 cubin); returns (size, kind)."""
    out = compiler.compile_using_nvrtc(loader.gpu_source(), tuple(nvrtc_options(defines)), arch=ARCH[3:],
                                       filename="all.cu")
    assert out, "CuPy's NVRTC returned nothing"
    return len(out), ("cubin" if isinstance(out, bytes) and out[:4] == b"\x7fELF" else "ptx")


def nvcc_with_size_probe(tmp_path: Path) -> tuple[str, Path]:
    """A wrapper around nvcc that records the size of the cubin it wrote, so that the
    loader's own command line (which writes into a temporary folder) can be measured."""
    real = shutil.which("nvcc")
    size_file = tmp_path / "cubin_size"
    wrapper = tmp_path / "nvcc"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"'{real}' \"$@\"\nrc=$?\n"
        "out=\nprev=\nfor a in \"$@\"; do [ \"$prev\" = -o ] && out=$a; prev=$a; done\n"
        f"[ -f \"$out\" ] && wc -c < \"$out\" > '{size_file}'\n"
        "exit $rc\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper), size_file


def gpu_modules() -> dict[str, tuple[str, ...]]:
    """The modules to compile, by name.

    The GPU loader compiles one module per (dtype, op) specialization (every kernel
    in each; loader.specialization()). By default: the data-movement module, every
    dtype with sum (type-specific code: conversions, Arith, Unsigned) and float32 with
    every other functor (op-specific code) -- 14 modules, a few seconds each. With
    COMMREF_TEST_ALL_GPU_MODULES=1: all of loader.all_specializations() and the full
    module (no defines: every kernel with every instance in one translation unit, what
    nvcc_compile_check() builds by default; minutes of ptxas on a small machine).
    """
    if not hasattr(loader, "specialization"):  # a loader without specialised modules
        return {"full": ()}
    from commref.collectives.verify import DTYPE_CODES, OPS

    dtype_names = {v: k for k, v in DTYPE_CODES.items()}
    op_names = {v: k for k, v in OPS.items()}
    everything = os.environ.get("COMMREF_TEST_ALL_GPU_MODULES", "") not in ("", "0")
    specs: dict[str, tuple[str, ...]] = {"data-movement": loader.specialization(None)}
    for dtype in sorted(dtype_names):
        for op in (0, 1, 2, 3):  # avg shares sum's module
            if everything or op == 0 or dtype == DTYPE_CODES["float32"]:
                specs[f"{dtype_names[dtype]}-{op_names[op]}"] = loader.specialization((dtype, op))
    if everything:
        assert sorted(set(specs.values())) == sorted(loader.all_specializations())
        specs["full"] = ()
    return specs


GPU_MODULES = gpu_modules()


@pytest.mark.parametrize("which", list(GPU_MODULES))
def test_every_kernel_compiles_for_sm90(which, tmp_path):
    defines = GPU_MODULES[which]
    t0 = time.perf_counter()
    if shutil.which("nvcc"):
        nvcc, size_file = nvcc_with_size_probe(tmp_path)
        kwargs = {"defines": defines} if defines else {}
        proc = loader.nvcc_compile_check(ARCH, nvcc=nvcc, **kwargs)
        elapsed = time.perf_counter() - t0
        assert proc.returncode == 0, f"nvcc failed for {ARCH} ({which}: {defines}):\n{proc.stderr[-6000:]}"
        size = int(size_file.read_text()) if size_file.exists() else 0
        assert size > 0, "nvcc reported success but wrote no cubin"
        print(f"nvcc {ARCH} {which}: cubin {size} bytes ({size / 2**20:.2f} MiB) in {elapsed:.1f} s")
        return
    backend, why = nvrtc_backend()
    if backend is None:
        pytest.skip("neither nvcc nor NVRTC (cuda-python's cuda.bindings.nvrtc or CuPy) is available: "
                    + "; ".join(why))
    kind, mod = backend
    if kind == "cuda-python":
        size, _ = compile_cuda_python(mod, defines)
        what = "cubin"
    else:
        size, what = compile_cupy(mod, defines)
    elapsed = time.perf_counter() - t0
    print(f"NVRTC ({kind}) {ARCH} {which}: {what} {size} bytes ({size / 2**20:.2f} MiB) in {elapsed:.1f} s")

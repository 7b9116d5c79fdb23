"""The GIN engines' common ground:

- interface: GinProxy and NativeProxy implement engine.GinEngine (NativeProxy also
  GinWindowEngine), checked structurally (members, signatures); a planted gap is named;
- build: a change in any part of native_engine/ changes the library's build key.
"""

from __future__ import annotations


def test_every_engine_implements_the_engine_interface():
    """The communicator's view of an engine (engine.GinEngine): the Python proxy, the
    native engine and the GPU copy-engine proxy have every member, with the protocol's
    signatures; the native engine alone carries kernels' windows, and it and the Python
    proxy carry host windows (add_window, for host one-sided calls: transports/gin/rma.py)."""
    from commref.transports.gin.engine import GinEngine, GinWindowEngine, interface_gaps
    from commref.transports.gin.gpu_proxy import GpuProxy
    from commref.transports.gin.native import NativeProxy
    from commref.transports.gin.proxy import GinProxy

    assert interface_gaps(GinProxy) == []
    assert interface_gaps(NativeProxy) == []
    assert interface_gaps(GpuProxy) == []
    assert interface_gaps(NativeProxy, GinWindowEngine) == []
    assert GinProxy.carries_windows is False and NativeProxy.carries_windows is True
    assert GpuProxy.carries_windows is False
    assert interface_gaps(GinProxy, GinWindowEngine) == []  # host windows only: carries_windows stays false
    assert GinProxy.carries_host_windows is True and NativeProxy.carries_host_windows is True
    assert not getattr(GpuProxy, "carries_host_windows", False)
    assert "GpuProxy.add_window: missing" in interface_gaps(GpuProxy, GinWindowEngine)

    class Planted:  # a quiesce without its timeout, a stats method, no trace, stop taking an argument
        carries_windows = False
        error = None

        def start(self): ...
        def quiesce(self): ...
        def stop(self, now): ...
        def pending(self, peer=None): ...
        def stats(self): ...

    gaps = interface_gaps(Planted, GinEngine)
    assert gaps == [
        "Planted.quiesce(): GinEngine has quiesce(timeout)",
        "Planted.stats: a method, GinEngine has an attribute",
        "Planted.stop(now): GinEngine has stop()",
        "Planted.trace: missing",
    ], gaps


def test_a_change_in_any_engine_part_rebuilds(tmp_path):
    """native.py builds engine.cpp with native_engine/ as an include folder, so every
    header there counts in the library's key (build.build_key)."""
    import shutil

    from commref.device_kernels import build
    from commref.transports.gin import native

    parts = sorted(p.name for p in native.ENGINE_DIR.iterdir() if p.suffix in (".h", ".cpp"))
    assert parts == [
        "contexts.h",
        "core.h",
        "engine.cpp",
        "idle.h",
        "lossy.h",
        "mpi_net.h",
        "shm_net.h",
        "unordered.h",
        "wire.h",
    ]
    copy = tmp_path / "native_engine"
    shutil.copytree(native.ENGINE_DIR, copy)

    def key():
        return build.build_key([copy / "engine.cpp"], (build.INCLUDE_DIR, copy), "settings")

    first = key()
    assert key() == first
    for part in parts:
        f = copy / part
        text = f.read_text()
        f.write_text(text + "\n// changed\n")
        assert key() != first, part
        f.write_text(text)
    assert key() == first
    assert native.INCLUDE_DIRS == (build.INCLUDE_DIR, native.ENGINE_DIR)
    for part in parts:  # every part under 700 lines
        assert len((native.ENGINE_DIR / part).read_text().splitlines()) < 700, part

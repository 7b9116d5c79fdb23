"""The ordering study (transports/gin/study/): every cell of the default matrix pinned,
every counterexample replayed on a fresh target memory, the reduced search checked
against the plain one, and the semantics helpers it adds."""

from __future__ import annotations

import json
import time

import pytest

from commref.cli import main as cli_main
from commref.transports.gin import semantics as sem
from commref.transports.gin.semantics import Event, Plan, Put, Signal
from commref.transports.gin.study import explorer, report, stress
from commref.transports.gin.study import signaling as pr

COLUMNS = [
    "ordered",
    "ordered/2ctx",
    "unordered",
    "unordered+block128",
    "unordered+duplicates",
    "unordered+flush_orders",
    "unordered/2ctx",
]

# Expected verdicts, one letter per column above (S safe, U unsafe), reasoned from the
# GIN contract (docs/gin.md) and semantics.enabled(), before running the explorer:
#
# - ordered: per-context FIFO, so every event of a context lands after every earlier one:
#   anything the receiver waits for (a signal, the last byte, the last line) implies all
#   earlier data on that context. Everything is safe.
# - /2ctx: contexts are separate ordering domains. The signal (or the last put) travels on
#   context 1, the data on context 0: neither FIFO nor a strong signal (which covers earlier
#   puts *on its context*) nor a flush of context 0 (per context in semantics) orders the
#   two, so every protocol that waits on a signal or on the last put is unsafe, ordered or
#   not. Counted writes (the counter counts placements on every context) and LL (each line
#   carries its own flag) do not care which context a put rides on. A torn LL line is
#   still in order inside its own put on an ordered wire (data before flag).
# - unordered: a weak signal implies only its own put; a strong one, every earlier put of
#   its context (applied in sequence order). So:
#   signal-per-put: n signals each implying its own put = all puts: safe, weak or strong.
#   last-put: weak implies only the last put (2 puts: unsafe); strong implies all: safe.
#   flush-signal: the signal is a bare signal; a weak one implies nothing (unsafe), a strong
#   one implies every earlier put (safe).
#   counted-writes: without duplicates the counter reaches the message size only when every
#   byte has been placed: safe.
#   headers: a signal (weak or strong) lands only after its own put, header included, so
#   the set of signalled puts is a subset of the puts with a valid header; count >= valid
#   headers makes the two sets equal, so every put read has landed: safe (DeepEP's rule).
#   ll-flag: a line lands whole (the atomicity assumption): safe. ll-flag-8B: the flag
#   segment may land before the data segment of its line: unsafe.
#   poll-last-byte: the last segment may land first: unsafe.
# - +block128: segments of a put land in order inside each aligned 128-byte block; nothing
#   else changes. An LL line (16-byte aligned) never straddles a block, so a torn line's
#   data lands before its flag: ll-flag-8B becomes safe (what LL128 relies on). poll-last-
#   byte stays unsafe (other blocks, other puts). The rest as unordered.
# - +duplicates: a segment may be placed twice. Rewriting the same bytes harms no reader,
#   but the placed-bytes counter counts the duplicate: counted-writes becomes unsafe (the
#   counter reaches the size while a segment is missing). The rest as unordered.
# - +flush_orders: the op after a flush lands only after earlier puts of its context: the
#   flush-signal's weak bare signal becomes safe. Protocols without a flush as unordered.
EXPECTED_ROWS = {
    # protocol, strength       ord  o/2c unord b128 dup flush u/2c
    ("signal-per-put", "weak"): "S U S S S S U",
    ("signal-per-put", "strong"): "S U S S S S U",
    ("last-put", "weak"): "S U U U U U U",
    ("last-put", "strong"): "S U S S S S U",
    ("flush-signal", "weak"): "S U U U U S U",
    ("flush-signal", "strong"): "S U S S S S U",
    ("counted-writes", "-"): "S S S S U S S",
    ("headers", "weak"): "S U S S S S U",
    ("headers", "strong"): "S U S S S S U",
    ("ll-flag", "-"): "S S S S S S S",
    ("ll-flag-8B", "-"): "S S U S U U U",
    ("poll-last-byte", "-"): "S U U U U U U",
}
EXPECTED = {
    (p, s, col): ("safe" if v == "S" else "unsafe")
    for (p, s), row in EXPECTED_ROWS.items()
    for col, v in zip(COLUMNS, row.split())
}


@pytest.fixture(scope="module")
def matrix():
    t0 = time.perf_counter()
    cells = explorer.run_matrix()
    return cells, time.perf_counter() - t0


def test_columns_and_rows_are_the_default_matrix(matrix):
    cells, _ = matrix
    assert [m.name for m in pr.MODELS] == COLUMNS
    assert {c.key() for c in cells} == set(EXPECTED)
    assert len(cells) == len(EXPECTED) == 84


def test_every_cell_verdict(matrix):
    cells, _ = matrix
    got = {c.key(): c.verdict for c in cells}
    wrong = {k: (got[k], EXPECTED[k]) for k in EXPECTED if got[k] != EXPECTED[k]}
    assert not wrong, f"cells whose verdict differs (got, expected): {wrong}"


def test_default_matrix_is_fast(matrix):
    _, seconds = matrix
    assert seconds < 60, f"the default matrix took {seconds:.1f} s"


def test_safe_cells_checked_every_shape(matrix):
    cells, _ = matrix
    n = len(pr.shapes(pr.DEFAULT_BOUND))
    assert n == 16
    for c in cells:
        if c.safe:
            assert c.shapes_checked == n and c.events is None


def test_every_counterexample_replays_to_a_wrong_read(matrix):
    cells, _ = matrix
    unsafe = [c for c in cells if not c.safe]
    assert len(unsafe) == sum(v == "unsafe" for v in EXPECTED.values())
    for c in unsafe:
        proto, model, prog = explorer.cell_program(c)
        assert c.shape.puts <= pr.DEFAULT_BOUND[0] and c.shape.units <= pr.DEFAULT_BOUND[1]
        assert c.shortest, c.key()
        # Every event is allowed where it lands (semantics.enabled), no event repeats.
        assert sem.first_disallowed(model.transport, prog.plan, c.events, model.strong_always) is None
        mem = prog.fresh()
        for e in c.events:
            sem.apply(prog.plan, e, prog.payload, mem)
        read = proto.receive(prog, mem)
        assert read is not None, f"{c.key()}: the receiver does not read at the end of the trace"
        stale = pr.stale_ranges(prog, mem, read)
        assert stale, f"{c.key()}: the receiver's read is correct at the end of the trace"
        for off, n in stale:  # stale bytes still hold what was there before the message
            assert all(b == pr.STALE for b in mem.window[off : off + n])
        # The trace printers agree with it.
        assert "UNSAFE" in report.trace_lines(c)[0]
        assert report.cell_json(c)["counterexample"]["read"]["stale"] == [[o, o + n] for o, n in stale]


def test_sample_counterexamples_are_the_expected_shortest(matrix):
    cells, _ = matrix
    by = {c.key(): c for c in cells}
    # Weak signal on the last put, unordered: the last put and its signal land; put 0 not.
    c = by[("last-put", "weak", "unordered")]
    assert (str(c.shape), c.events) == ("2x1", [Event(1, 0), Event(1, -1)])
    # Counted writes with duplicates: one segment placed twice, the other never.
    c = by[("counted-writes", "-", "unordered+duplicates")]
    assert (str(c.shape), c.events) == ("1x2", [Event(0, 0), Event(0, 0, 1)])
    # Weak bare signal after a flush: lands first.
    c = by[("flush-signal", "weak", "unordered")]
    assert (str(c.shape), c.events) == ("1x1", [Event(1, -1)])
    # A torn LL line: the flag segment lands before the data segment.
    c = by[("ll-flag-8B", "-", "unordered")]
    assert (str(c.shape), c.events) == ("1x1", [Event(0, 1)])
    # Headers with the signal on another context: a header and a bare signal, body missing.
    c = by[("headers", "weak", "ordered/2ctx")]
    assert str(c.shape) == "1x2" and set(c.events) == {Event(0, 0), Event(1, -1)}


def _small_shapes():
    return [s for s in pr.shapes((4, 4)) if s.puts * s.units <= 6]


@pytest.mark.parametrize("proto", pr.PROTOCOLS, ids=lambda p: p.name)
def test_reduced_search_agrees_with_plain_search(proto):
    """Per message shape (up to 6 segments or lines in all), the reduced search (victims
    + persistent sets) finds a wrong read exactly when the plain BFS does."""
    for strength in proto.strengths:
        for model in pr.MODELS:
            for shape in _small_shapes():
                prog = proto.program(shape, strength, model.split_ctx)
                reduced = explorer.search(prog, proto, model, por=True)
                plain = explorer.search(prog, proto, model, por=False)
                assert (reduced is None) == (plain is None), (proto.name, strength, model.name, str(shape))
                if reduced is not None:
                    assert explorer.replay(prog, proto, model, reduced)[2]


class _Put1OncePut2NotPut0(pr.Protocol):
    """A toy non-monotone receiver (not a protocol of the matrix): three one-segment puts
    without signals; the receiver reads put 1 once put 2 has landed and put 0 has not.
    Landing put 0 makes it read nothing, so the reduction must branch on every event
    (Protocol.may_falsify stays True for all of them)."""

    name = "toy-put1-once-put2-not-put0"
    strengths = (None,)
    monotone = False

    def program(self, shape, strength, split_ctx):
        s = pr._Sender()
        for _, off, data in self._data_puts(shape):
            s.put(0, off, data)
        return self._program(s, shape)

    def receive(self, prog, mem):
        if len(prog.puts) != 3:
            return None  # the toy is about three puts; smaller shapes never read
        (off0, _), (off1, n1), (off2, _) = [(p.offset, p.nbytes) for p in prog.puts]
        if mem.window[off2] != pr.STALE and mem.window[off0] == pr.STALE:
            return pr.Read(((off1, n1),), "put 2 landed, put 0 not")
        return None


def test_reduced_search_follows_every_branch_of_a_non_monotone_receiver():
    """On the unordered model, its one wrong read is put 2 landing first (put 1 is then
    read stale). From the empty state, with put 1 as the victim, the enabled events are
    put 0 and put 2: a search that followed only the first would land put 0 and never
    see the read. The plain search finds the counterexample; the reduced one must too."""
    proto, model = _Put1OncePut2NotPut0(), pr.MODEL_BY_NAME["unordered"]
    prog = proto.program(pr.Shape(3, 1), None, False)
    plain = explorer.search(prog, proto, model, por=False)
    assert plain == [Event(2, 0)]
    assert explorer.replay(prog, proto, model, plain)[2] == [(64, 64)]
    reduced = explorer.search(prog, proto, model, por=True)
    assert reduced is not None, "the reduced search missed the counterexample the plain search finds"
    assert explorer.replay(prog, proto, model, reduced)[2]
    cell = explorer.run_cell(proto, None, model, bound=(3, 1))
    assert not cell.safe and cell.events == [Event(2, 0)]


def test_no_event_disables_another():
    """The reductions rely on it: landing an event never removes another from enabled().
    Checked on every reachable state of small programs of every protocol and model."""
    for proto in pr.PROTOCOLS:
        for strength in proto.strengths:
            for model in pr.MODELS:
                for shape in (pr.Shape(2, 2), pr.Shape(3, 1)):
                    prog = proto.program(shape, strength, model.split_ctx)
                    tr, plan = model.transport, prog.plan
                    seen, todo = {frozenset()}, [frozenset()]
                    while todo:
                        landed = todo.pop()
                        en = sem.enabled(tr, plan, landed)
                        for e in en:
                            nxt = landed | {e}
                            after = set(sem.enabled(tr, plan, nxt))
                            assert set(en) - {e} <= after, (proto.name, model.name, sorted(landed), e)
                            if nxt not in seen:
                                seen.add(nxt)
                                todo.append(nxt)


def test_larger_bound_keeps_verdicts():
    cells = explorer.run_matrix(
        protocols=[pr.PROTOCOL_BY_NAME["last-put"], pr.PROTOCOL_BY_NAME["headers"]], bound=(5, 3)
    )
    for c in cells:
        assert c.verdict == EXPECTED[c.key()], c.key()
        assert c.safe or c.shapes_checked <= 15


def test_programs():
    # Flush then signal: the signal is the op after the flush.
    prog = pr.FlushSignal().program(pr.Shape(2, 2), "weak", False)
    assert [p.nbytes for p in prog.puts] == [128, 128, 0]
    assert [p.after_flush for p in prog.puts] == [False, False, True]
    assert prog.puts[2].signal == Signal(False)
    # Split contexts: data on 0, bare signals on 1, sequence numbers per context.
    prog = pr.SignalPerPut().program(pr.Shape(2, 1), "strong", True)
    assert [(p.ctx, p.seq, p.nbytes, p.signal is not None) for p in prog.puts] == [
        (0, 0, 64, False),
        (1, 0, 0, True),
        (0, 1, 64, False),
        (1, 1, 0, True),
    ]
    # Every payload byte differs from the stale fill, so a stale byte shows.
    for proto in pr.PROTOCOLS:
        prog = proto.program(pr.Shape(4, 4), proto.strengths[-1], False)
        assert pr.STALE not in prog.image
    # LL lines: 8 data bytes, then the flag; 16-byte segments (8-byte for ll-flag-8B).
    prog = pr.LLFlag().program(pr.Shape(1, 2), None, False)
    assert prog.plan.segs[0] == [(0, 16), (16, 16)] and prog.image[8:16] == pr.LL_FLAG
    assert pr.LLFlagTorn().program(pr.Shape(1, 1), None, False).plan.segs[0] == [(0, 8), (8, 8)]


def test_semantics_target_memory():
    tr = sem.Transport("u+dup", ordered=False, duplicates=True)
    puts = [
        Put(0, 0, 0, 16),
        Put(0, 1, 16, 8, Signal(True, ("index", 2), 5)),
        Put(0, 2, 0, 0, Signal(False, ("va", 32), 3)),
    ]
    plan = Plan.of(puts, 8)
    payload = [bytes(range(1, 17)), bytes(range(17, 25)), b""]
    mem = sem.TargetMemory.fresh(40)
    for e in (Event(0, 1), Event(0, 1, 1), Event(2, -1), Event(2, -1)):
        sem.apply(plan, e, payload, mem)
    assert bytes(mem.window[8:16]) == bytes(range(9, 17)) and bytes(mem.window[0:8]) == bytes(8)
    assert mem.placed_bytes == 16  # the duplicate counted again
    assert int.from_bytes(mem.window[32:40], "little") == 6  # VA signal added twice
    sem.apply(plan, Event(1, -1), payload, mem)
    assert mem.signal(2) == 5 and mem.signals == {("index", 2): 5}
    assert mem.landed[:2] == [Event(0, 1), Event(0, 1, 1)]
    copy = mem.copy()
    copy.window[0] = 99
    assert mem.window[0] == 0
    # first_disallowed: the strong signal of op 1 needs op 0's data and its own.
    order = [Event(0, 0), Event(1, -1)]
    assert sem.first_disallowed(tr, plan, order) == 1
    assert sem.first_disallowed(tr, plan, [Event(0, 0), Event(0, 1), Event(1, 0), Event(1, -1)]) is None
    assert sem.first_disallowed(tr, plan, [Event(0, 0, 1)]) == 0  # a duplicate before its original
    assert sem.first_disallowed(tr, plan, [Event(0, 0), Event(0, 0)]) == 1  # repeated


def test_cli_json_and_filters(capsys):
    assert cli_main(["study", "--protocol", "last-put", "--transport", "unordered", "ordered", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    got = {(c["protocol"], c["strength"], c["transport"]): c["verdict"] for c in out["cells"]}
    assert got == {
        ("last-put", "weak", "unordered"): "unsafe",
        ("last-put", "weak", "ordered"): "safe",
        ("last-put", "strong", "unordered"): "safe",
        ("last-put", "strong", "ordered"): "safe",
    }
    cex = next(c for c in out["cells"] if c["verdict"] == "unsafe")["counterexample"]
    assert [t["what"] for t in cex["trace"]] == ["op1 seg0 [64,128)", "op1 signal (weak, index 0 += 1) -> 1"]
    assert cex["read"]["stale"] == [[0, 64]]
    assert out["bound"] == {"puts": 4, "units": 4}


def test_cli_text(capsys):
    assert cli_main(["study", "--protocol", "counted-writes", "--bound", "2x2"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("counted-writes"))
    assert row.split()[2:] == ["safe", "safe", "safe", "safe", "UNSAFE", "safe", "safe"]
    assert "placed bytes = 128 >= 128" in out and "bound 2x2" in out
    assert cli_main(["study", "--bound", "4by4"]) == 2
    assert capsys.readouterr().err == "commref study: error: --bound wants PxS (e.g. 4x4), not '4by4'\n"


def test_stress_on_the_proxy_agrees_with_the_explorer():
    """Part of `commref study --stress` on the real GIN proxy (ThreadWorld, shm wire):
    cells proven safe show no corruption, a torn LL line and a bare signal on another
    context show theirs, and every delivery order the proxy produced is one
    semantics.enabled() allows for the explorer's plan of the program."""
    P, M = pr.PROTOCOL_BY_NAME, pr.MODEL_BY_NAME
    picks = [
        ("last-put", "strong", "unordered"),
        ("headers", "weak", "unordered+duplicates"),
        ("flush-signal", "weak", "unordered+flush_orders"),
        ("ll-flag", None, "unordered"),
        ("ll-flag-8B", None, "unordered"),
        ("signal-per-put", "weak", "unordered/2ctx"),
    ]
    cells = []
    for p, s, m in picks:
        cells += stress.run_stress([P[p]], [M[m]], [s] if s else None, seeds=2, messages=4)
    by = {c.key(): c for c in cells}
    assert len(by) == len(picks)
    for p, s, m in picks:
        c = by[(p, s or "-", m)]
        assert c.verdict == EXPECTED[c.key()]
        assert c.messages == 8 and c.orders_checked == 8 and c.orders_disallowed == 0, c
        assert c.agrees, c
        if c.verdict == "safe":
            assert c.corrupted == 0, c
        else:
            assert c.corrupted > 0 and c.example, c
    text = report.format_stress(cells, 2, 4, pr.DEFAULT_BOUND)
    assert (
        "0 not allowed" in text and "disagreements (a safe cell corrupted, or an order the model forbids): none" in text
    )


def test_stress_observes_every_unsafe_cell_on_ordered_2ctx():
    """The ordered/2ctx column of `commref study --stress`: the sender's proxy runs the
    ordered wire with independent contexts (scheduler.py), so a context's traffic is held
    back while the other context's overtakes it. Every cell the explorer marks unsafe
    there is observed (some message read stale data), every safe one never corrupts, and
    every landing order the proxy produced is one semantics.enabled() allows."""
    cells = stress.run_stress(models=[pr.MODEL_BY_NAME["ordered/2ctx"]], seeds=10, messages=5)
    stressed = [c for c in cells if not c.skipped]
    assert {c.key() for c in cells} == {k for k in EXPECTED if k[2] == "ordered/2ctx"}
    assert len(stressed) == 11 and sum(c.verdict == "unsafe" for c in stressed) == 9
    for c in stressed:
        assert c.verdict == EXPECTED[c.key()], c
        assert c.messages == 50 and c.orders_checked == 50 and c.orders_disallowed == 0, c
        if c.verdict == "safe":
            assert c.corrupted == 0, c
        else:
            assert c.corrupted > 0 and c.example, c
    assert "unsafe but not observed" not in report.format_stress(cells, 10, 5, pr.DEFAULT_BOUND)


@pytest.mark.parametrize("network", ["shm", "mpi"])
def test_stress_under_mpirun_agrees_with_the_explorer(network, shm_leak_check):
    """`commref study --stress` as 2 MPI processes (mpiexec -n 2): rank 0 posts through its
    proxy over the shm wire (or sends MPI messages to rank 1's proxy), rank 1 polls its
    own window with receive() in another process. Safe cells show no corruption,
    last-put [weak] and ll-flag-8B on unordered are observed, and every delivery order is
    one the model allows."""
    from conftest import run_mpi

    t0 = time.perf_counter()
    r = run_mpi(
        2,
        [
            "commref.cli",
            "study",
            "--stress",
            "--json",
            "--protocol",
            "last-put",
            "ll-flag-8B",
            "--transport",
            "ordered",
            "unordered",
            "--seeds",
            "2",
            "--messages",
            "4",
            "--network",
            network,
        ],
        timeout=60,
        module=True,
    )
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout)  # rank 0 alone prints
    by = {(c["protocol"], c["strength"] or "-", c["transport"]): c for c in out["stress"]["cells"]}
    assert len(by) == 6
    for key, c in by.items():
        assert c["world"] == "mpi" and c["network"] == network and c["agrees"], c
        assert c["verdict"] == EXPECTED[key], c
        assert c["messages"] == 8 and c["polls"] >= 8 and c["orders_disallowed"] == 0, c
        assert c["orders_checked"] == 8, c  # the ordered wire's landing orders are checked too
        if c["verdict"] == "safe":
            assert c["corrupted"] == 0, c
    for key in [("last-put", "weak", "unordered"), ("ll-flag-8B", "-", "unordered")]:
        assert by[key]["verdict"] == "unsafe" and by[key]["corrupted"] > 0 and by[key]["example"], by[key]
    assert elapsed < 30, elapsed


def test_stress_np_and_network_checks(capsys):
    """--np is for --stress only, and 2 ranks only; the mpi wire needs MPI. Each is one
    line `commref study: error: ...` and exit status 2, before anything runs."""
    for argv, message in [
        (["--np", "2", "--protocol", "last-put"], "--np needs --stress"),
        (["--stress", "--np", "3"], "--np must be 2"),
        (["--stress", "--network", "mpi", "--protocol", "last-put"], "--network mpi needs --np 2"),
    ]:
        assert cli_main(["study", *argv]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(f"commref study: error: {message}") and captured.err.count("\n") == 1
        assert captured.out == ""


def _unsafe_cells(protocols, models):
    P, M = pr.PROTOCOL_BY_NAME, pr.MODEL_BY_NAME
    cells = explorer.run_matrix([P[p] for p in protocols], [M[m] for m in models])
    return cells, [c for c in cells if not c.safe]


def test_chart_draws_each_counterexample():
    """`commref study --plot`: one message sequence chart per unsafe cell, titled by
    protocol [strength] x transport, with one posting arrow per piece the sender posts,
    one landing arrow per event of the counterexample (a duplicate placement included),
    the receiver's wait and one stale-read mark."""
    pytest.importorskip("matplotlib", reason="the chart needs matplotlib (pip install 'commref[bench]')")
    from commref.transports.gin.study import chart

    cells, unsafe = _unsafe_cells(
        ["last-put", "counted-writes", "ll-flag-8B"], ["ordered", "unordered", "unordered+duplicates", "unordered/2ctx"]
    )
    # last-put weak: unord, +dup, unord/2ctx; strong: unord/2ctx; counted-writes: +dup; ll-flag-8B: 3 unordered.
    assert len(unsafe) == 8
    fig = chart.figure(cells)
    try:
        axes = [ax for ax in fig.axes if ax.get_title()]
        assert len(axes) == len(unsafe)
        for ax, c in zip(axes, unsafe):
            assert ax.get_title().startswith(f"{c.protocol} [{c.strength or '-'}] x {c.model}\n")
            _, model, prog = explorer.cell_program(c)
            landings = [t for t in ax.texts if t.get_gid() == chart.LANDING_GID]
            posts = [t for t in ax.texts if t.get_gid() == chart.POST_GID]
            assert len(landings) == len(c.events), c.key()
            assert len(posts) == sum(1 for e in prog.plan.all_events(model.transport) if e.copy == 0), c.key()
            assert len([a for a in ax.collections if a.get_gid() == chart.STALE_GID]) == 1
            assert len([p for p in ax.patches if p.get_gid() == chart.WAIT_GID]) == 1
        dup = next(ax for ax, c in zip(axes, unsafe) if c.protocol == "counted-writes")
        assert any(t.get_text().startswith("2. op0 seg0 [0,64) duplicate") for t in dup.texts)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    with pytest.raises(ValueError, match="every selected cell is safe"):
        chart.figure([c for c in cells if c.safe])


def test_cli_plot_writes_the_chart(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the chart needs matplotlib (pip install 'commref[bench]')")
    path = tmp_path / "study.png"
    assert cli_main(["study", "--protocol", "last-put", "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"# --plot: 8 counterexamples drawn to {path}" in out  # last-put: 6 weak + 2 strong unsafe cells
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    safe = tmp_path / "safe.png"
    assert cli_main(["study", "--protocol", "ll-flag", "--plot", str(safe)]) == 0
    assert "no counterexample to draw" in capsys.readouterr().out and not safe.exists()
    assert cli_main(["study", "--plot", str(tmp_path / "nowhere" / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("commref study: error: no folder ") and err.count("\n") == 1


def test_text_output_starts_with_title_and_legend(capsys):
    assert cli_main(["study", "--protocol", "headers", "ll-flag-8B", "poll-last-byte", "--bound", "2x2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("commref study: can a receiver following each protocol (rows) read stale data")
    assert "2 puts x 2 segments" in lines[0]
    table = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["ord", "ord/2ctx"])
    legend = lines[1:table]
    for name in ("headers", "ll-flag-8B", "poll-last-byte"):
        line = next(ln for ln in legend if ln.split()[:1] == [name])
        assert pr.PROTOCOL_BY_NAME[name].doc in line
    for m in pr.MODELS:
        assert any(ln.split()[:2] == [m.short, f"{m.name}:"] for ln in legend), m.name
    for mark in ("[weak] [strong]", "[-]", "safe", "UNSAFE"):
        assert any(ln.strip().startswith(mark + " ") for ln in legend), mark
    assert legend.index("Rows: protocol [signal strength]; a protocol is a sender program and a receiver check:") == 0
    # The model lines are the legend's: not repeated after the table.
    assert not any(ln.strip().startswith("unord/2ctx ") for ln in lines[table + 1 :])


def test_stress_prints_its_own_table_unless_explore(capsys):
    argv = [
        "study",
        "--stress",
        "--seeds",
        "1",
        "--messages",
        "1",
        "--protocol",
        "last-put",
        "--transport",
        "unordered",
        "--strength",
        "weak",
    ]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("Corrupted messages per cell on the GIN proxy")
    assert "U 1/1" in out or "U 0/1" in out
    assert "can a receiver following" not in out and "UNSAFE" not in out and "cells, 1 unsafe" not in out
    assert "wrong: stale bytes" not in out
    assert cli_main(argv + ["--explore"]) == 0
    both = capsys.readouterr().out
    assert both.startswith("commref study: can a receiver following")
    assert "wrong: stale bytes" in both and "# 1 cells, 1 unsafe" in both
    assert both.index("# 1 cells, 1 unsafe") < both.index("Corrupted messages per cell on the GIN proxy")

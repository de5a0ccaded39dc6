"""The command line refuses arguments it cannot use before it does any work: numbers that are
not finite, lists of loads that are not loads, files and folders it could not write, batch
options that would lose or overwrite something. Each answer is exit code 2 and one line
saying what is wrong, never a traceback."""

from __future__ import annotations

import math
import typing
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from sluice.cli.app import app
from sluice.cli.params import FiniteGroup, make_finite


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit
    ), f"{args}: {result.exception!r}"
    return result.exit_code, result.output


@pytest.fixture()
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    lines = [
        f'{{"timestamp": {i * 100}, "input_length": 1024, "output_length": 8, '
        f'"hash_ids": [{i % 3}, {100 + i}]}}'
        for i in range(20)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _float_params(command: object, path: str = "sluice") -> list[tuple[str, object]]:
    found = []
    for param in getattr(command, "params", []):
        desc = getattr(param, "type_descriptor", None)
        if desc is not None and float in (desc.annotation, *typing.get_args(desc.annotation)):
            found.append((f"{path} {param.name}", param))
    for name, sub in getattr(command, "commands", {}).items():
        found += _float_params(sub, f"{path} {name}")
    return found


def test_every_float_of_the_command_line_refuses_inf_and_nan() -> None:
    command = typer.main.get_command(app)
    assert isinstance(command, FiniteGroup)  # its main() runs make_finite first
    make_finite(command)
    params = _float_params(command)
    assert len(params) > 30, [n for n, _ in params]
    for name, param in params:
        check = param.callback  # type: ignore[attr-defined]
        assert check is not None, f"{name} takes inf"
        for bad in (math.inf, -math.inf, math.nan):
            with pytest.raises(typer.BadParameter, match="not a finite number"):
                check(None, param, bad)
        assert check(None, param, 1.5) == 1.5


@pytest.mark.parametrize(
    "args",
    [
        ["replay", "--trace", "{trace}", "--workers", "2", "--compare", "sluice",
         "--deadline-s", "inf"],
        ["replay", "--trace", "{trace}", "--workers", "2", "--compare", "sluice",
         "--slo-ttft-s", "inf"],
        ["replay", "--trace", "{trace}", "--workers", "2", "--compare", "sluice",
         "--batch-load", "inf"],
        ["submit", "--model", "m", "--deadline-s", "nan", "--prompt", "hi"],
    ],
)  # fmt: skip
def test_a_number_that_is_not_finite_is_refused(args: list[str], trace: Path) -> None:
    code, out = _run(*(a.replace("{trace}", str(trace)) for a in args))
    assert code == 2 and "not a finite number" in out, out


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["replay", "sweep", "--trace", "{trace}", "--loads", "nan"], "numbers of 0.01 or more"),
        (["replay", "sweep", "--trace", "{trace}", "--loads", "0.5,0"], "of 0.01 or more"),
        (["replay", "sweep", "--trace", "{trace}", "--loads", "a"], "comma-separated numbers"),
        (["replay", "sweep-batch", "--trace", "{trace}", "--batch-loads", "0,inf"],
         "zero or more"),
        (["bench-routers", "--trace", "{trace}", "--loads", "-1", "--simulate"], "of 0.01 or more"),
    ],
)  # fmt: skip
def test_loads_are_finite_and_positive(args: list[str], said: str, trace: Path) -> None:
    code, out = _run(*(a.replace("{trace}", str(trace)) for a in args))
    assert code == 2 and said in out, out


def test_sampling_out_of_range_is_refused_before_the_broker_is_asked() -> None:
    # (No broker on this URL: the refusal must come before any connect, at once.)
    code, out = _run(
        "submit", "--model", "m", "--prompt", "hi", "--temperature", "-1",
        "--config", "/dev/null",
    )  # fmt: skip
    assert code == 2 and "temperature" in out and "greater than or equal to 0" in out, out


def test_outputs_that_cannot_be_written_are_refused_before_the_work(
    trace: Path, tmp_path: Path
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (["replay", "--trace", str(trace), "--workers", "2", "--compare", "sluice",
          "--plot", str(a_file)], "a file, not a folder"),
        (["replay", "sweep", "--trace", str(trace), "--loads", "1", "--plot", str(a_file)],
         "a file, not a folder"),
        (["replay", "gen", "--scenario", "rag", "--out", str(tmp_path)], "a folder, not a file"),
        (["replay", "gen", "--scenario", "rag", "--out", str(tmp_path / "no" / "x.jsonl")],
         "no folder"),
        # Before the first request: the URL answers nothing.
        (["loadgen", "--url", "http://127.0.0.1:9/v1", "--trace", str(trace), "--json",
          str(tmp_path)], "a folder, not a file"),
        (["bench-routers", "--trace", str(trace), "--simulate", "--json", str(tmp_path)],
         "a folder, not a file"),
    ]  # fmt: skip
    for args, said in cases:
        code, out = _run(*args)
        assert code == 2 and said in out, (args, out)
    written = tmp_path / "ok.jsonl"
    code, out = _run("replay", "gen", "--scenario", "rag", "--requests", "5", "--out", str(written))
    assert code == 0 and len(written.read_text().splitlines()) == 5, out


def test_batch_options_that_would_lose_work_are_refused(tmp_path: Path) -> None:
    """Checked before any connection: no broker runs here."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    line = tmp_path / "one.jsonl"
    line.write_text('{"custom_id": "a", "model": "m", "prompt": "hi"}\n')
    cases = [
        (["batch", "results", "b1", "--output", str(tmp_path / "x"), "--errors",
          str(tmp_path / "." / "x")], "one would overwrite the other"),
        (["batch", "results", "b1", "--output", str(tmp_path)], "a folder, not a file"),
        (["batch", "submit", str(empty)], "has no request line"),
        (["batch", "submit", str(line), "--endpoint", "/v1/bogus"], "--endpoint is one of"),
    ]  # fmt: skip
    for args, said in cases:
        code, out = _run(*args)
        assert code == 2 and said in out, (args, out)


def test_up_with_settings_the_gateway_refuses_stops_before_starting_anything() -> None:
    code, out = _run("up", "--host", "0.0.0.0", "--nats-port", "-1", "--port", "0")
    assert code == 2 and "not a loopback address" in out and "nats-server pid" not in out, out
    code, out = _run("up", "--workers", "100000")
    assert code == 2 and "less than or equal to 64" in out, out


def test_the_benchmarks_refuse_what_they_cannot_run_as_asked(
    tmp_path: Path, trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each was a traceback, a silent empty run, or a file named like an option (a helper's
    probe of the benchmark commands); each is now exit code 2 and one line, before any
    engine, router or nats-server starts."""
    missing = str(tmp_path / "nope.jsonl")
    for args, said in [
        (["bench-routers", "--simulate", "--trace", missing], "trace not found"),
        (["bench-routers", "--arms", ",", "--trace", str(trace)], "no arm to run"),
        (
            ["bench-routers", "--arms", "round-robin", "--kv-page-tokens", "3"],
            "kv_page_tokens: the KV page size divides",
        ),
        (["bench-routers", "--simulate", "--arms", "bogus"], "--arms: not for --simulate"),
        (["bench-routers", "--arms", ",", "--json", "--no-progress"], "--json takes a file"),
        (["bench", "--skip-live", "--live-requests", "10"], "--live-requests: size the live"),
        (["replay", "sweep-batch", "--trace", str(trace), "--admissions", ","], "--admissions"),
        (["replay", "--trace", str(trace), "--decisions", str(trace)], "is the trace itself"),
    ]:
        code, out = _run(*args)
        assert code == 2 and said in out, (args, out)
    assert trace.read_text().startswith('{"timestamp"')  # not overwritten by --decisions
    partial = tmp_path / "r.json"
    partial.write_text('{"policies": {"x": 1}, "floor": {}}')
    code, out = _run("replay", "report", str(partial))
    assert code == 2 and "not the output of `sluice replay --json`" in out, out

    # No nats-server: said at once (it was a traceback after the core's minutes).
    from sluice.testing import natsserver
    from sluice.testing.errors import NatsServerError

    def no_binary() -> str:
        raise NatsServerError("nats-server not found")

    monkeypatch.setattr(natsserver, "find_binary", no_binary)
    code, out = _run("bench", "--requests", "10", "--decision-requests", "10")
    assert code == 2 and "or give --skip-live" in out, out


def test_the_engine_refuses_an_address_it_cannot_serve_on() -> None:
    """A busy port or an unknown host was uvicorn's log line and exit code 3; a socket in a
    missing folder a traceback; a page size without KV events was ignored."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = str(busy.getsockname()[1])
        code, out = _run("engine", "--port", port)
        assert code == 2 and f"cannot serve on http://127.0.0.1:{port}" in out, out
        assert "serving" not in out, out  # one line: the banner comes once it is bound
    code, out = _run("engine", "--port", "18001", "--host", "999.1.1.1")
    assert code == 2 and "cannot serve on http://999.1.1.1:18001" in out, out
    code, out = _run("engine", "--uds", "/nonexistent/dir/sock")
    assert code == 2 and "no folder for the socket" in out, out
    code, out = _run("engine", "--uds", "/tmp/x.sock", "--kv-page-tokens", "4")
    assert code == 2 and "give an endpoint for them" in out, out
    code, out = _run("engine", "--port", "18001", "--kv-events-port", "65535")
    assert code == 2, out  # its replay port would be 65536


def test_the_stack_and_broker_commands_refuse_before_they_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each was a traceback, a silent misreading or a figure of nothing (a helper's probe of
    ``up``, ``nats``, ``bench-lease``, ``bench-failover`` and ``bench-broker-failover``)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for args, said in [
        # A message holding "[...]" was read as markup: dropped, or a MarkupError traceback.
        (["up", "--engines", "[/x]"], "not '[/x]'"),
        (["up", "--engines", "[test]"], "not '[test]'"),
        (["up", "--model", ""], "--model takes a model name"),
        (["up", "--model", "--speed"], "--model takes a model name"),
        (["nats", "--port", "0"], "give -1 for any free one"),
        (["nats", "--cluster", "3", "--port", "65534"], "needs ports up to 65536"),
        (["nats", "--store-dir", str(afile)], "a file, not a folder"),
        (["nats", "--store-dir", "--cluster"], "--store-dir takes a folder"),
        (["bench-lease", "--lease-s", "0.5"], "greater than or equal to 3"),  # 3 heartbeats
        (["bench-broker-failover", "--publish-timeout-s", "-1"], "'--publish-timeout-s'"),
        (["bench-broker-failover", "--target", "[bogus]"], "not '[bogus]'"),
        # Past these, a run of nothing (then "no request completed"), and a cost per prompt
        # token measured over no span ("+ 0.0 B per prompt token").
        (["demo", "--sessions", "0", "--rag-rate", "0", "--batch-rate", "0"], "no load"),
        (["bench-memory", "--prompt-tokens", "64"], "'--prompt-tokens'"),
        # Past these (a helper's probe): the dispatcher's limit, a traceback minutes later;
        # a stream of 10^8 requests, a MemoryError; 20,000 HTTP clients, 16.7 GB; more than
        # the wire takes, a traceback after the cluster started; sizes the run would not use.
        (["bench-memory", "--prompt-tokens", "1000001"], "'--prompt-tokens'"),
        (["bench", "--requests", "100000000"], "'--requests'"),
        (["bench", "--decision-requests", "100000000"], "'--decision-requests'"),
        (["bench-gateway", "--concurrency", "20000"], "'--concurrency'"),
        (["bench-gateway", "--concurrency", "300", "--burst", "100"], "more than a burst"),
        (["bench-gateway", "--max-tokens", "1000001"], "'--max-tokens'"),
        (["bench", "--live-only", "--requests", "50"], "--requests: size the core figures"),
        (["bench", "--submitters", "100", "--throughput-requests", "50"],
         "more than the throughput's 50 requests"),
    ]:  # fmt: skip
        code, out = _run(*args)
        assert code == 2 and said in out, (args, out)
    assert not (Path.cwd() / "--cluster").exists()

    # Settings from the environment that do not validate: one line, not pydantic's traceback.
    monkeypatch.setenv("SLUICE_DISPATCHER_LEASE_S", "abc")
    code, out = _run("bench-failover", "--runs", "1", "--workers", "1")
    assert code == 2 and "invalid settings" in out and "lease_s" in out, out
    monkeypatch.delenv("SLUICE_DISPATCHER_LEASE_S")

    from sluice.testing import natsserver
    from sluice.testing.errors import NatsServerError

    def no_binary() -> str:
        raise NatsServerError("nats-server not found")

    monkeypatch.setattr(natsserver, "find_binary", no_binary)
    for args in (["bench-failover", "--runs", "1"], ["bench-lease", "--runs", "1"]):
        code, out = _run(*args)
        assert code == 2 and "nats-server not found" in out, (args, out)


def test_replays_refuse_what_they_would_run_twice_or_not_at_all(
    tmp_path: Path, trace: Path
) -> None:
    """Each was a traceback, a silent repeat, a load that changed nothing, or a file named
    like an option (a helper's probe of ``sluice replay``)."""
    instant = tmp_path / "instant.jsonl"
    instant.write_text(
        "".join('{"timestamp": 1000, "input_length": 64, "output_length": 4}\n' for _ in range(5))
    )
    good = tmp_path / "good.json"
    code, out = _run("replay", "--trace", str(trace), "--workers", "2", "--compare", "random",
                     "--json")  # fmt: skip
    assert code == 0, out
    doc = next(line for line in out.splitlines() if line.startswith("{"))  # (stderr mixed in)
    good.write_text(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(doc.replace('"goodput_rps": ', '"goodput_rps": NaN, "x": ', 1))
    for args, said in [
        (["replay", "sweep-batch", "--trace", str(trace), "--batch-loads", "0",
          "--policy", "sluice,random"], "--policy is one of"),
        (["replay", "--trace", str(trace), "--slow-workers", "1", "--slow-factor", "1e308"],
         "'--slow-factor'"),
        (["replay", "--trace", str(trace), "--decisions", "--json"], "--decisions takes a file"),
        (["replay", "--trace", str(instant), "--load", "0.5"], "a load needs arrivals"),
        (["replay", "sweep", "--trace", str(trace), "--loads", "1e-300"], "of 0.01 or more"),
        (["replay", "sweep", "--trace", str(trace), "--loads", "1,1"], "more than once"),
        (["replay", "--trace", str(trace), "--compare", "random, random"], "random more than once"),
        (["replay", "--trace", str(trace), "--compare", " , "], "--compare names no policy"),
        (["replay", "sweep-batch", "--trace", str(trace), "--admissions", "engine,engine"],
         "engine more than once"),
        (["replay", "report", str(good), str(bad)], "NaN is no figure"),
        (["replay", "--trace", str(trace), "--slow-factor", "2"], "go together"),
        (["replay", "--trace", str(trace), "--slow-workers", "1"], "go together"),
        (["replay", "--trace", "."], "is a folder, not a trace file"),
        (["replay", "gen", "--scenario", "mixed", "--out", str(tmp_path / "g.jsonl"),
          "--rate", "1e308"], "'--rate'"),
        (["replay", "gen", "--scenario", "mixed", "--out", str(tmp_path / "g.jsonl"),
          "--requests", "1000000000"], "'--requests'"),
    ]:  # fmt: skip
        code, out = _run(*args)
        assert code == 2 and said in out, (args, out)
        assert "**good**" not in out  # nothing printed before every file was read
    assert not (Path.cwd() / "--json").exists()
    assert not (tmp_path / "g.jsonl").exists()


@pytest.mark.parametrize("command", [[], ["sweep"], ["sweep-batch"]])
def test_a_replay_of_a_missing_trace_makes_no_plot_folder(
    tmp_path: Path, command: list[str]
) -> None:
    """The trace is checked before ``--plot``'s folder is made (it was made, then the command
    stopped on the missing trace, leaving an empty folder behind)."""
    plots = tmp_path / "plots"
    code, out = _run(
        "replay", *command, "--trace", str(tmp_path / "none.jsonl"), "--plot", str(plots)
    )
    assert code == 2 and "trace not found" in out, out
    assert not plots.exists()


def test_bench_checks_its_fleet_settings_before_the_core() -> None:
    """A bad SLUICE_ variable for the live fleet killed its dispatcher after the core's
    minutes, and the error said only "a fleet process ended early"."""
    result = CliRunner().invoke(app, ["bench", "--json"], env={"SLUICE_DISPATCHER_LEASE_S": "abc"})
    assert result.exit_code == 2, result.output
    assert "the live fleet's settings" in result.output and "lease_s" in result.output


def test_a_verdict_says_how_the_figure_stands_to_its_target() -> None:
    """For a figure where higher is better the factor was the target over the figure: 0.50
    against a target of 0.4 read "within target, 0.80x the target"."""
    from sluice.cli import app as face
    from sluice.cli.benchlive import HotFigures

    hot = HotFigures(
        latency_requests=10, dispatch_p50_ms=1.0, dispatch_p99_ms=2.0, publish_ack_p50_ms=0.5,
        publish_ack_between_p50_ms=0.5, submit_p50_ms=0.5, request_reply_p50_ms=0.1,
        throughput_requests=10, submitters=1, agents=4, prompt_tokens=256, throughput_rps=50.0,
        dispatcher_cpu_ms_per_request=0.0, agent_cpu_ms_per_request=0.0, raw_jetstream_rps=100.0,
        raw_jetstream_concurrent_rps=200.0,
    )  # fmt: skip
    with face.console.capture() as captured:
        face._print_hot(hot)
    said = captured.get()
    assert "throughput / raw JetStream: 0.50 (target >= 0.4); within target, 1.25x" in said
    assert "dispatch p50 / publish ack: 2.00 (target <= 4); within target, 0.50x" in said
    assert "too few requests to count" in said

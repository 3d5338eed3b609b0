"""What the CLI says, as a user reads it: errors that point the right way, help that fits, numbers in plain units
(issue 26's small things)."""

from __future__ import annotations

import json

import pytest
from helpers import one_line_error, run

from meshplan.core.units import fmt_seconds


@pytest.mark.parametrize("t,text", [(4.44e-16, "0 us"), (0.0, "0 us"), (5e-7, "0.5 us"), (0.0009996, "1 ms"),
                                    (0.0012, "1.2 ms"), (0.99996, "1 s"), (1.33, "1.33 s"), (999.9, "1,000 s"),
                                    (1330.0, "1,330 s"), (-0.002, "-2 ms")])
def test_seconds_read_in_plain_units(t, text):
    """No exponent at a unit's edge (999.96 ms is 1 s) and no float round-off shown as a time."""
    assert fmt_seconds(t) == text


@pytest.fixture(scope="module")
def schedule_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("s") / "s.json"
    r = run("simulate", "--algo", "ring", "--gpus", 2, "--topo", "cpu-local", "--seq-len", 256, "--heads", 2,
            "--kv-heads", 2, "--head-dim", 16, "--out", path)
    assert r.exit_code == 0, r.stderr
    return path


def test_compare_with_its_files_swapped_says_so(schedule_file, tmp_path):
    measurement = tmp_path / "m.json"
    measurement.write_text(json.dumps({"measurement_version": "1.0", "schedule": "x"}))
    one_line_error(run("compare", measurement, schedule_file), "m.json", "is a measurement",
                   "meshplan compare SCHEDULE MEASUREMENT")
    one_line_error(run("compare", schedule_file, schedule_file), "is a schedule, not a measurement")


def test_a_truncated_schedule_is_named_as_cut_short(schedule_file, tmp_path):
    cut = tmp_path / "trunc.json"
    cut.write_bytes(schedule_file.read_bytes()[:300])
    for command in ("validate", "simulate"):
        r = run(command, cut)
        one_line_error(r, "trunc.json: is not valid JSON", "cut short")
        assert ": :" not in r.stderr


def test_a_cut_gzip_a_missing_file_and_a_directory_say_what_they_are(schedule_file, tmp_path):
    """Not the Python exception's name (EOFError, FileNotFoundError): what is wrong with the file and the fix."""
    import gzip

    cut = tmp_path / "trunc.json.gz"
    cut.write_bytes(gzip.compress(schedule_file.read_bytes())[:200])
    one_line_error(run("validate", cut), "trunc.json.gz: the compressed file is cut short or corrupted", "regenerate")
    one_line_error(run("validate", tmp_path / "none.json"), "none.json: no such file", "meshplan simulate --out")
    one_line_error(run("simulate", tmp_path), "cannot read the schedule (Is a directory)")
    for r in (run("validate", cut), run("validate", tmp_path / "none.json")):
        assert "Error" not in r.stderr


def test_a_sequence_no_layout_splits_names_seq_len_and_the_padding_that_runs():
    """No candidate because the sequence does not split over the GPUs: the sequence's own error (it used to name
    --gpus and send the user to --json, which printed the same line), and its suggestion runs."""
    r = run("search", "--gpus", 16, "--topo", "h100x16", "--seq-len", 1000, "--json")
    one_line_error(r, "--seq-len: 1000 is not a multiple of 2·N = 32", "--seq-len 1024 --valid-len 1000")
    fixed = run("search", "--gpus", 16, "--topo", "h100x16", "--seq-len", 1024, "--valid-len", 1000, "--write", 0,
                "--json")
    assert fixed.exit_code == 0 and json.loads(fixed.stdout)["candidates"], fixed.stderr


def test_simulate_title_has_no_empty_knobs():
    r = run("simulate", "--algo", "ring", "--gpus", 2, "--topo", "h100x8", "--seq-len", "8K")
    assert r.exit_code == 0 and r.stdout.startswith("ring on h100x8 x 2:"), r.stdout[:200]


def test_json_on_schema_and_topo_list():
    assert json.loads(run("schema", "--json").stdout)["title"] == "ScheduleJSON"
    names = json.loads(run("topo", "list", "--json").stdout)
    assert "h100x32" in names and "cpu-local" in names


@pytest.mark.parametrize("command", [["search"], ["simulate"], ["plan-batch"], ["compare"], ["run"]])
def test_help_fits_80_columns_and_shows_no_flag_types(command, monkeypatch):
    """A flag takes no value, so no ``<bool>`` beside it; panel titles (with the workload's defaults) are not cut."""
    monkeypatch.setenv("COLUMNS", "80")
    r = run(*command, "--help")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert max(len(x) for x in lines) <= 80
    assert "<bool>" not in r.stdout
    if command[0] in ("search", "plan-batch"):
        assert "[required]" in r.stdout and "[default: bf16]" in r.stdout


@pytest.fixture(scope="module")
def search_body():
    r = run("search", "--gpus", 16, "--topo", "h100x32", "--seq-len", "64K", "--write", 0, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def _rendered(body, width: int, wide: bool) -> list[str]:
    from rich.console import Console

    from meshplan.show.search_table import print_search
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    print_search(body, console, 10, wide)
    return console.export_text().splitlines()


def test_search_output_fits_100_columns(search_body):
    """The compact table and everything under it (framework settings whole, one per line) within 100 columns."""
    lines = _rendered(search_body, 100, wide=False)
    assert max(len(x) for x in lines) <= 100
    assert any(x.strip() == "--cp-comm-type a2a+p2p" for x in lines), lines      # a framework flag, whole
    assert not any("…" in x for x in lines)                                       # nothing cut


def test_search_output_at_80_columns_keeps_the_plans_words(search_body):
    """A terminal under 96 columns: the passes' columns give way, so a knob (``ulysses_degree=4``) is never cut
    inside a word; every line within 80."""
    lines = _rendered(search_body, 80, wide=False)
    assert max(len(x) for x in lines) <= 80
    header = next(x for x in lines if "plan" in x)
    assert "fwd" not in header and "bwd" not in header
    from meshplan.show.search_table import plan_text

    words = {w for line in lines for w in line.replace("│", " ").split()}
    for c in search_body["candidates"][:10]:
        assert set(plan_text(c).split()) <= words, plan_text(c)          # each word whole on one line


def test_search_wide_shows_every_column_uncut(search_body):
    lines = _rendered(search_body, 100, wide=True)
    header = next(x for x in lines if "algorithm" in x)
    for col in ("layout", "knobs", "level", "bytes/GPU", "comp/comm", "peak mem (+ws)"):
        assert col in header, header


def test_piped_output_defaults_to_100_columns(monkeypatch):
    from meshplan.show.console import out_width
    monkeypatch.delenv("COLUMNS", raising=False)
    assert out_width() == 100                          # pytest's stdout is not a terminal
    monkeypatch.setenv("COLUMNS", "132")
    assert out_width() == 132


def test_piped_output_has_no_trailing_spaces(monkeypatch, capsys):
    """Piped, the console drops the spaces rich leaves where it wraps a line and pads a table's title with; a line
    printed in pieces still comes out whole."""
    from rich.table import Table

    from meshplan.show.console import out_console
    monkeypatch.setenv("COLUMNS", "60")
    say = out_console()
    say.print("word " * 40, markup=False)
    table = Table(title="a title narrower than its table")
    table.add_column("a column with a long header")
    table.add_column("another one")
    say.print(table)
    say.file.write("a line written ")
    say.file.write("in two pieces\n")
    say.file.flush()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) > 6 and not any(line.endswith(" ") for line in lines) and max(map(len, lines)) <= 60
    assert "a line written in two pieces" in lines and "word word" in lines[0]


def test_ring_is_the_reference_row(search_body):
    """Ring's best setting, simulated, is in --json as ``reference`` (one of the candidates) and in the table, and
    the pick's lead over it is said; no Ring candidate simulated faster than it."""
    ref = search_body["reference"]
    assert ref["algorithm"] == "ring" and ref["model_level"] == "simulated"
    assert ref in search_body["candidates"]
    rings = [c for c in search_body["candidates"] if c["algorithm"] == "ring"]
    from meshplan.search.ranking import reference_slack

    slack = reference_slack(search_body["counts"]["prune_slack"])   # no Ring setting beats it by more than that
    assert all(ref["predicted"]["makespan_s"] * (1 - slack) <= (
        c["predicted"]["makespan_s"] if c["model_level"] == "simulated" else c["bound_s"]) for c in rings)
    text = "\n".join(_rendered(search_body, 100, wide=False))
    best = search_body["candidates"][0]["predicted"]["makespan_s"]
    assert f"#1 is {ref['predicted']['makespan_s'] / best:.2f}x as fast as Ring's best setting" in text
    close = any(c["model_level"] != "simulated" and c["bound_s"] < ref["predicted"]["makespan_s"] for c in rings)
    assert ("Ring's best setting to within 3%" in " ".join(text.split())) == close
    assert "│ ring │" in text or "ring zigzag" in text
    # Ring left at its bounds (above 256 ranks): a claim on every Ring setting, not on which one is best
    from meshplan.show.search_table import _vs_ring_text
    near = {**ref, "model_level": "closed-form", "bound_s": 0.99 * ref["predicted"]["makespan_s"]}
    line = _vs_ring_text({**search_body, "candidates": search_body["candidates"] + [near]})   # within the margin
    assert "as fast as Ring's best setting to within 3% (" in line
    bounded = {**ref, "model_level": "closed-form"}
    cands = [bounded if c is ref else c for c in search_body["candidates"]]
    line = _vs_ring_text({**search_body, "reference": bounded, "candidates": cands})
    assert line.startswith(f"#1 is at least {ref['predicted']['makespan_s'] / best:.2f}x as fast as any Ring setting")
    assert "the least of their lower bounds" in line and "best setting" not in line


def test_why_in_words(search_body):
    """Under the table: what bounds #1 (from its exposed communication against its time), its bytes across nodes
    against Ring's, its memory against the device's, and what #1's lead over #2 is made of."""
    from meshplan.show.search_table import why_lines

    one = search_body["candidates"][0]["predicted"]
    lines = why_lines(search_body)
    share = one["exposed_comm_s"] / one["makespan_s"]
    bound = "compute-bound" if share < 0.1 else "mostly compute" if share < 0.5 else "communication-bound"
    assert lines[0].startswith(f"why: {bound}"), lines
    assert "across nodes per GPU, Ring" in lines[0] and "of 80 GB per GPU" in lines[0]
    if search_body["candidates"][1]["model_level"] == "simulated":
        assert lines[1].startswith("#1 beats #2")


def test_a_long_suggested_command_pastes_as_it_is():
    """A command wider than the terminal is broken before its flags with backslash continuations: each line fits,
    and the shell reads the lines back as the one command."""
    import shlex

    from meshplan.show.search_table import command_lines
    command = ("meshplan simulate --algo mesh --gpus 1024 --topo h100x32 --seq-len 1048576 --batch 1 --heads 32 "
               "--kv-heads 8 --head-dim 128 --dtype bf16 --mask causal --layout contiguous --pass fwd+bwd "
               "--tile 16x64 --mapping row-major")
    lines = command_lines(command, 100)
    assert len(lines) > 1 and max(len(x) for x in lines) <= 100
    assert shlex.split("\n".join(lines).replace("\\\n", " ")) == command.split()


def test_each_commands_summary_is_one_paragraph_line():
    """The commands panel of `meshplan --help` shows each docstring's first paragraph with its line breaks kept (rich
    markup): a summary wrapped in the source broke mid-sentence there (`--gpus is the` / `CP group size …`)."""
    import typer

    from meshplan.cli.app import app

    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        first = (cmd.help or "").strip().split("\n\n")[0]
        assert "\n" not in first, (name, first)

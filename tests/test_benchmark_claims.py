"""What the README, docs/ and benchmarks/RESULTS.md claim is what the benchmark scripts print, check and exit with.

* Each figure quoted by the README's tables (the benchmarks' rows and the paper's evaluation), the README's
  SLURM paragraph, docs/slurm.md's table of measured figures and docs/architecture.md's Scale section equals
  one table cell or one printed line of the results it cites (:data:`CLAIMS`): a RESULTS.md section's table
  cell or output line (the SLURM figures: ``slurm.py``'s section), or the report ``scale.py --report`` prints
  from ``benchmarks/scale_results.json``. A figure quoted with fewer digits equals the printed one rounded to
  them; never a number found elsewhere in the section. Every number of a README figure cell and of
  docs/slurm.md's measured figures is one of those claims (none left unchecked).
* The scale report in RESULTS.md is what ``scale.py --report`` prints from the tree's results file; the
  results file keys runs by what they depend on (TTL, etcd members, commit) and shows a TTL it did not
  record as not recorded.
* Every verdict a benchmark prints can say "met" and "NOT met", and a "NOT met" makes the script exit 1
  (each on synthetic results, in process).
* ``transition.py --only-hang`` counts restarted survivors and lost steps from a run's own files (its
  judgement, in process, on files laid out as a run writes them).
* ``etcd_failover.py`` fails, saying why, when the store's failover is disabled (a client pinned to one
  endpoint; e2e: a real cluster and job).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal, InvalidOperation
from functools import cache
from pathlib import Path

import pytest

from conftest import REPO

BENCHMARKS = os.path.join(REPO, "benchmarks")
sys.path.insert(0, BENCHMARKS)

NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*(?![\d])")
#: The source of the figures that ``scale.py --report`` prints from ``benchmarks/scale_results.json``.
SCALE_REPORT = "scale.py --report, printed from benchmarks/scale_results.json"


def _plain(text: str) -> str:
    """One spelling for what documents and scripts write differently (one character for one: spans keep)."""
    return text.replace("\u2212", "-").replace("\u00d7", "x").replace("\u2013", "-")


# -- where figures come from -------------------------------------------------------------------------------
def _results_sections(text: str | None = None) -> dict[str, str]:
    """benchmarks/RESULTS.md's sections by the command in their heading (``transition.py --only-hang``)."""
    text = Path(BENCHMARKS, "RESULTS.md").read_text() if text is None else text
    sections = {}
    for heading, body in re.findall(r"^## `([^`]+)`[^\n]*\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M):
        sections[heading.strip()] = _plain(body)
    return sections


@cache
def _scale_report() -> str:
    """What ``scale.py --report`` prints from the tree's results file (no plots written)."""
    import _scale_report as report
    import scale

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report.report(scale._load(), plots=False)
    return _plain(out.getvalue())


def _sources() -> dict[str, str]:
    return {**_results_sections(), SCALE_REPORT: _scale_report()}


def line(pattern: str) -> Callable[[str], str]:
    """The figure of the one printed line ``pattern`` (a regex with one group, anchored at the line's start)."""
    regex = re.compile("^" + pattern, re.M)

    def find(text: str) -> str:
        found = regex.findall(text)
        assert len(found) == 1, f"{len(found)} lines match {pattern!r}"
        return found[0]

    find.__doc__ = f"line {pattern!r}"
    return find


def _tables(text: str) -> list[tuple[str, list[dict[str, str]]]]:
    """The markdown tables of ``text``: each its title (the nearest line above it that is not empty) and its
    rows, a row its cells by the header's column names."""
    tables, lines = [], text.splitlines()
    for i, row in enumerate(lines[:-1]):
        if row.startswith("|") and re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1]) and (
                i == 0 or not lines[i - 1].startswith("|")):
            header = [c.strip() for c in row.strip().strip("|").split("|")]
            body = []
            for rest in lines[i + 2:]:
                if not rest.startswith("|"):
                    break
                body.append(dict(zip(header, (c.strip() for c in rest.strip().strip("|").split("|")))))
            title = next((above for above in reversed(lines[:i]) if above.strip()), "")
            tables.append((title, body))
    return tables


def cell(column: str, pattern: str | None = None, table: str = "", **row: str) -> Callable[[str], str]:
    """The figure of one table cell: in the table whose title holds ``table``, the row whose cells equal ``row``
    (``N="64"``: keyword ``N``), ``column``.

    The cell must hold one number (the figure), or ``pattern`` (a regex with one group) picks it.
    """
    names = {key.replace("_", " "): value for key, value in row.items()}

    def find(text: str) -> str:
        rows = [r for title, body in _tables(text) if table in title for r in body if column in r
                and all(r.get(name) == value for name, value in names.items())]
        assert len(rows) == 1, f"{len(rows)} table rows with {names} and a column {column!r}"
        value = rows[0][column]
        if pattern is not None:
            found = re.search(pattern, value)
            assert found, f"cell {column!r} of {names} is {value!r}: no {pattern!r} in it"
            return found.group(1)
        numbers = NUMBER.findall(value)
        assert len(numbers) == 1, f"cell {column!r} of {names} is {value!r}: not one figure"
        return numbers[0]

    find.__doc__ = f"cell {column!r} of the row {names}" + (f" of the table {table!r}" if table else "")
    return find


def per_run(scenario: str, pick: Callable[[list[float]], float]) -> Callable[[str], str]:
    """A figure of the stalls of one ``slurm.py`` scenario's ``per run:`` line (its minimum, its maximum)."""
    regex = re.compile(rf"^{re.escape(scenario)}\s.*\n\s+per run: (\[.*\])$", re.M)

    def find(text: str) -> str:
        found = regex.findall(text)
        assert len(found) == 1, f"{len(found)} per-run lines of {scenario}"
        return f"{pick([first for first, *_ in json.loads(found[0].replace('(', '[').replace(')', ']'))]):.3f}"

    find.__doc__ = f"{pick.__name__} of the per-run stalls of {scenario}"
    return find


def constant(value: Callable[[], float]) -> Callable[[str], str]:
    """A figure that is the code's own (a default), whatever the section says."""

    def find(text: str) -> str:
        return f"{value():g}"

    find.__doc__ = "a constant of the code"
    return find


def _hang_floor() -> float:
    from unicron_elastic.detection.hang import HangThresholds

    return HangThresholds().min_silence


# -- what quotes them ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Claim:
    """Figures one part of a document quotes and the results they must equal.

    Attributes:
        doc: The quoting document (a path in the repository).
        where: The part of it: the start of a table row's first cell, or a heading (``## ...``) for its section.
        quoted: A regex on that part, one group per figure (none: the words alone must be there).
        source: The results: a RESULTS.md section's command, or :data:`SCALE_REPORT`.
        printed: For each group of ``quoted``, how the source gives the figure (:func:`line`, :func:`cell`,
            :func:`per_run`, :func:`constant`).
        holds: For words without a figure ("nobody restarted"): a regex of a line the source must print.
    """

    doc: str
    where: str
    quoted: str
    source: str
    printed: tuple[Callable[[str], str], ...] = ()
    holds: str | None = None


def _readme(where: str, quoted: str, source: str, *printed: Callable[[str], str]) -> Claim:
    return Claim("README.md", where, quoted, source, printed)


SLURM = "slurm.py"
NUMBER_S = r"([\d.]+)"
#: docs/slurm.md's rows of a lost node and the ``slurm.py`` scenario each quotes.
LOST_ROWS = (("a node lost, an etcd follower on it", "lost-follower"), ("a node lost, no member on it", "lost-site"),
             ("a node lost, the etcd leader on it", "lost-leader"))
CLAIMS: tuple[Claim, ...] = (
    _readme("`unicron-run` and the agent",
            rf"exit {NUMBER_S} s, hang {NUMBER_S} s \(the (\d+) s floor\), node {NUMBER_S} s; (\d+) false hang "
            r"verdicts in (\d+) x (\d+) steps under each distribution", "detection.py",
            line(r"process exit\s+([\d.]+) s"), line(r"hang \(D_iter 0\.1 s\)\s+([\d.]+) s"), constant(_hang_floor),
            line(r"node loss \(TTL 1 s\)\s+([\d.]+) s"), line(r"false verdicts of the progress rule: (\d+);"),
            line(r"Hang verdicts on healthy ranks, (\d+) runs"),
            line(r"Hang verdicts on healthy ranks, \d+ runs x (\d+)")),
    _readme("Lightning strategy", rf"kill → next step {NUMBER_S} s vs {NUMBER_S} s restart-all \({NUMBER_S}x\); "
            r"overhead ([-+\d.]+) % vs `ddp`", "transition.py --skip-torch",
            line(r"kill -> step done, unicron_megatron\s+:\s+([\d.]+) s"),
            line(r"kill -> step done, ddp restart-all \+ ckpt\s+:\s+([\d.]+) s"), line(r"speed-up\s+:\s+([\d.]+)x"),
            line(r"overhead\s+:\s+([-+\d.]+) %")),
    _readme("precision and snapshots", rf"unicron / ddp {NUMBER_S} at `32-true`, {NUMBER_S} at `bf16-mixed` on CPU",
            "gpu.py", line(r"32-true\s+\|[^|]*\|\s+[\d.]+\s+[\d.]+\s+([\d.]+) \|"),
            line(r"bf16-mixed\s+\|[^|]*\|\s+[\d.]+\s+[\d.]+\s+([\d.]+) \|")),
    _readme("precision and snapshots", r"a (\d+) MB snapshot blocks the step (\d+) ms, one copy (\d+) ms",
            "snapshot.py", line(r"state: (\d+) MB"), line(r"the step blocked in save\(\) .*: median (\d+) ms"),
            line(r"one plain copy of the state: (\d+) ms")),
    _readme("TP × PP × DP",
            r"overhead vs a plain TP loop ([-+\d.]+) % to ([-+\d.]+) % at width (\d+), target (\d+) %",
            "transition.py --only-tp",
            cell("overhead", command="`python benchmarks/transition.py --only-tp --runs 4 --tp-width 256`"),
            cell("overhead", command="`python benchmarks/transition.py --only-tp --runs 3`"),
            cell("width", command="`python benchmarks/transition.py --only-tp --runs 3`"),
            line(r"\| command \| width \| strategy \| plain loop \| overhead \| target ≤ (\d+) % \|")),
    _readme("distributed optimizer", rf"state per rank off its share by {NUMBER_S} %; step {NUMBER_S}x the replicated "
            rf"engine's, {NUMBER_S}x megatron-core's; a kill costs the next step {NUMBER_S} ms more", "sharded.py",
            line(r"12 x P / \(DP / I\)\s+: \d+ bytes; worst rank off by ([\d.]+) %"), line(r"ratio\s+:\s+([\d.]+)x"),
            line(r"megatron-core's DistributedOptimizer .*; sharded / megatron-core: ([\d.]+)x"),
            line(r"sharded - unsharded\s+:\s+([\d.]+) ms")),
    _readme("engine `ElasticDataParallel`", rf"kill → step {NUMBER_S} s vs {NUMBER_S} s \({NUMBER_S}x\)",
            "transition.py", line(r"unicron ElasticDataParallel, kill -> step done :\s+([\d.]+) s"),
            line(r"torchrun restart-all \+ checkpoint reload \+ redo :\s+([\d.]+) s"),
            line(r"speed-up\s+:\s+([\d.]+)x")),
    _readme("node loss", rf"{NUMBER_S} s vs {NUMBER_S} s restart-all", "transition.py --only-node-lost",
            cell("unicron-run kill → survivors' step", rendezvous="defaults"),
            cell("torchrun restart-all + reload + redo", rendezvous="defaults")),
    _readme("hangs and frozen nodes", rf"hung rank → step {NUMBER_S} s \(the (\d+) s floor of the hang verdict\), "
            rf"frozen node {NUMBER_S} s; (\d+) survivors restarted, (\d+) steps lost", "transition.py --only-hang",
            line(r"one rank hung\s+([\d.]+) s"), constant(_hang_floor), line(r"node frozen\s+([\d.]+) s"),
            line(r"survivors restarted: (\d+),"), line(r"survivors restarted: \d+, steps lost: (\d+),")),
    _readme("planner", rf"{NUMBER_S} ms for (\d+) tasks x (\d+) GPUs, (\d+)x the paper's DP, target (\d+)x: "
            r"(met|not met)", "planner.py",
            line(r"ours \(candidates\) :\s+([\d.]+) ms"), line(r"== (\d+) tasks x \d+ GPUs =="),
            line(r"== \d+ tasks x (\d+) GPUs =="), line(r"speed-up\s+:\s+(\d+)x"),
            line(r"speed-up\s+:\s+\d+x\s+target >= (\d+)x"), line(r"speed-up\s+:\s+\d+x\s+target >= \d+x: (met|NOT met)")),
    _readme("coordinator, node daemons", rf"event → plan {NUMBER_S} ms median", "coordinator.py",
            line(r"  median ([\d.]+) ms,")),
    _readme("DataLoader prefetch", rf"{NUMBER_S} ms vs {NUMBER_S} ms per step", "dataloader.py",
            line(r"num_workers=2: median step\s+([\d.]+) ms"), line(r"num_workers=0: median step\s+([\d.]+) ms")),
    *(_readme(row, rf"^\| {row} \| {NUMBER_S}x \| {NUMBER_S}x \| {NUMBER_S}x \| {NUMBER_S}x \|$",
              "unicron simulate all", *(cell(system, pattern=r"([\d.]+)x", trace=row)
                                        for system in ("Megatron", "Oobleck", "Bamboo", "Varuna")))
      for row in ("trace-a, ours", "trace-a, paper", "trace-b, ours", "trace-b, paper")),
    # the README's SLURM paragraph: benchmarks/slurm.py's figures
    _readme("## On SLURM", rf"\({NUMBER_S} s with a (\d+) s TTL; {NUMBER_S} s when the lost node held the etcd "
            r"leader", SLURM, line(r"lost-follower\s+kill -> survivors' next step\s+([\d.]+) s"),
            line(r"== examples/slurm/train.sbatch on a loopback SLURM .*node TTL (\d+) s\)"),
            line(r"lost-leader\s+kill -> survivors' next step\s+([\d.]+) s")),
    # docs/slurm.md's table of measured figures: each lost row's median, range, restarts and verdict
    *(claim for row, scenario in LOST_ROWS for claim in (
        Claim("docs/slurm.md", row, rf"\| {NUMBER_S} s \({NUMBER_S}-{NUMBER_S}\), nobody restarted", SLURM,
              (line(rf"{scenario}\s+kill -> survivors' next step\s+([\d.]+) s"), per_run(scenario, min),
               per_run(scenario, max))),
        Claim("docs/slurm.md", row, "nobody restarted", SLURM, holds=rf"{scenario}\s+kill -> .*workers restarted: 0$"),
        Claim("docs/slurm.md", row, r"\*\*(met|not met)\*\*", SLURM,
              (line(rf"{scenario}\s+kill -> .*target <= TTL \+ 1 = \d+ s: (met|NOT met);"),)))),
    Claim("docs/slurm.md", "a node lost, an etcd follower on it", r"≤ TTL \+ (\d+) = (\d+) s", SLURM,
          (line(r"lost-follower\s+kill -> .*target <= TTL \+ (\d+) ="),
           line(r"lost-follower\s+kill -> .*TTL \+ 1 = (\d+) s"))),
    Claim("docs/slurm.md", "a node drained", rf"\| {NUMBER_S} s \(one run\)", SLURM,
          (line(r"drain\s+drain -> leave request\s+([\d.]+) s"),)),
    Claim("docs/slurm.md", "the warning: signal", rf"\| {NUMBER_S} s; {NUMBER_S} s \(one run\)", SLURM,
          (line(r"warning\s+signal -> checkpoint\s+([\d.]+) s"),
           line(r"warning\s+signal -> .*-> requeued ([\d.]+) s"))),
    Claim("docs/slurm.md", "the warning: signal", "the requeued run's first step is the checkpoint's next", SLURM,
          holds=r"warning\s+signal -> .*the requeued job's first step is the checkpoint's next: yes$"),
    # docs/architecture.md's Scale section: the scale report of benchmarks/scale_results.json
    Claim("docs/architecture.md", "## 6. Scale", r"measured at (\d+) and (\d+) nodes", SCALE_REPORT,
          (line(r"VERDICT (?:NOT )?met: steady writes .*measured at N=(\d+):"),
           line(r"VERDICT (?:NOT )?met: steady writes .*measured at N=\d+: [\d.]+, N=(\d+):"))),
    Claim("docs/architecture.md", "## 6. Scale",
          rf"leader and standby together: {NUMBER_S} keep-alives, (\d+) transactions and (\d+) reads a second",
          SCALE_REPORT, (line(r"per node: .*coordinator and standby: .*, ([\d.]+) keep-alives/s\)"),
                         line(r"per node: .*coordinator and standby: .*\(([\d.]+) writes/s"),
                         line(r"per node: .*coordinator and standby: .*writes/s, ([\d.]+) reads/s"))),
    Claim("docs/architecture.md", "## 6. Scale",
          r"a loss at (\d+) nodes: (\d+) compare-and-sets, (\d+) watch events, (\d+) writes in all", SCALE_REPORT,
          tuple(cell(column, table="one node lost among N", design="after", etcd="one", N="64")
                for column in ("N", "dedup CAS", "watch events", "writes"))),
    Claim("docs/architecture.md", "## 6. Scale",
          rf"with the per-node rates measured at (\d+) nodes, {NUMBER_S} keep-alives and {NUMBER_S} other requests a "
          r"second, and the coordinators' ([\d.]+), ([\d,]+) nodes at TTL 2 s stay under ([\d,]+) requests a second",
          SCALE_REPORT, (line(r"== extrapolation .*measured at N=(\d+),"),
                         line(r"per node: ([\d.]+) keep-alives/s"), line(r"per node: .* \+ ([\d.]+) other requests/s"),
                         line(r"per node: .*coordinator and standby: ([\d.]+) requests/s"),
                         line(r"largest cluster within \d+ requests/s: (\d+) nodes"),
                         line(r"largest cluster within (\d+) requests/s"))),
)


# -- the check -----------------------------------------------------------------------------------------------
def _parts(text: str, where: str) -> list[tuple[str, int]]:
    """The parts of a document ``where`` names, with their offsets: a heading's section, or the table rows whose
    first cell starts with ``where``."""
    where = _plain(where)
    if where.startswith("#"):
        heading = re.search(rf"^{re.escape(where)}.*$", text, re.M)
        if heading is None:
            return []
        after = re.search(rf"^{where.split(' ', 1)[0]} ", text[heading.end():], re.M)
        return [(text[heading.start():heading.end() + after.start() if after else len(text)], heading.start())]
    parts, offset = [], 0
    for row in text.splitlines(keepends=True):
        if row.startswith("|") and row.strip("| \n").startswith(where):
            parts.append((row, offset))
        offset += len(row)
    return parts


def same(quoted: str, printed: str) -> bool:
    """``quoted`` is the printed figure, written with as many digits or fewer (rounded), or the same word."""
    quoted, printed = (_plain(x).replace(",", "").strip() for x in (quoted, printed))
    if quoted == printed:
        return True
    try:
        q, p = Decimal(quoted), Decimal(printed)
    except InvalidOperation:
        return quoted.lower() == printed.lower()
    exponent = q.as_tuple().exponent
    if exponent < p.as_tuple().exponent:  # more digits quoted than printed
        return False
    step = Decimal(1).scaleb(exponent)
    return any(p.quantize(step, rounding=mode) == q for mode in (ROUND_HALF_UP, ROUND_HALF_EVEN))


def check(claim: Claim, docs: dict[str, str], sources: dict[str, str]) -> tuple[list[str], list[tuple[int, int]]]:
    """What is wrong with one claim (empty: its figures are the printed ones), and the spans of the figures it
    checked in its document."""
    parts = _parts(_plain(docs[claim.doc]), claim.where)
    if len(parts) != 1:
        return [f"{claim.doc}: {len(parts)} parts {claim.where!r}"], []
    part, offset = parts[0]
    found = list(re.finditer(claim.quoted, re.sub(r"\s", " ", part) if claim.where.startswith("#") else part,
                             re.M))
    if len(found) != 1:
        return [f"{claim.doc}, {claim.where!r}: {len(found)} matches of {claim.quoted!r}"], []
    match = found[0]
    if claim.source not in sources:
        return [f"{claim.doc} cites {claim.source!r}: no such section in benchmarks/RESULTS.md"], []
    wrong = []
    if claim.holds is not None and not re.search("^" + claim.holds, sources[claim.source], re.M):
        wrong.append(f"{claim.doc}, {claim.where!r} says {claim.quoted!r}: {claim.source} prints no {claim.holds!r}")
    for i, printed in enumerate(claim.printed, start=1):
        try:
            figure = printed(sources[claim.source])
        except AssertionError as exc:
            wrong.append(f"{claim.doc}, {claim.where!r}: {claim.source}: {exc}")
            continue
        if not same(match.group(i), figure):
            wrong.append(f"{claim.doc}, {claim.where!r} quotes {match.group(i)!r} where {claim.source} prints "
                         f"{figure!r} ({printed.__doc__})")
    spans = [(offset + match.start(i), offset + match.end(i)) for i in range(1, len(claim.printed) + 1)]
    return wrong, spans


def _unchecked_numbers(text: str, start: int, end: int, spans: list[tuple[int, int]]) -> list[str]:
    """The numbers of ``text[start:end]`` outside code spans, links and ``spans`` (the checked figures)."""
    part = re.sub(r"`[^`\n]*`|\[[^\]]*\]\([^)]*\)", lambda m: " " * len(m.group()), text[start:end])
    return [m.group() for m in NUMBER.finditer(part)
            if not any(a <= start + m.start() and start + m.end() <= b for a, b in spans)]


def _figure_cells(text: str, first: str, last: str, column: int) -> list[tuple[int, int]]:
    """The spans of one column's cells of the table rows between the headings ``first`` and ``last``."""
    begin, stop = text.index(first), text.index(last)
    cells, offset = [], 0
    for row in text.splitlines(keepends=True):
        if begin <= offset < stop and row.startswith("|") and not set(row.strip()) <= set("|-: "):
            edges = [m.start() for m in re.finditer(r"\|", row)]
            if len(edges) > column + 1:
                cells.append((offset + edges[column] + 1, offset + edges[column + 1]))
        offset += len(row)
    return cells


#: The table columns whose every number must be a checked figure: (document, from, to, column).
FIGURE_COLUMNS = (("README.md", "## What is there today", "### The paper's evaluation", 2),
                  ("docs/slurm.md", "## Measured", "## Limits", 1), ("docs/slurm.md", "## Measured", "## Limits", 2))


def mismatches(docs: dict[str, str], sources: dict[str, str]) -> list[str]:
    """Every claim's wrong figures, and every figure of :data:`FIGURE_COLUMNS` that no claim checks."""
    wrong, spans = [], {}
    for claim in CLAIMS:
        found, checked = check(claim, docs, sources)
        wrong += found
        spans.setdefault(claim.doc, []).extend(checked)
    for doc, first, last, column in FIGURE_COLUMNS:
        text = _plain(docs[doc])
        for start, end in _figure_cells(text, first, last, column):
            unchecked = _unchecked_numbers(text, start, end, spans.get(doc, []))
            if unchecked:
                wrong.append(f"{doc}: figures no claim checks: {unchecked} in {text[start:end].strip()!r}")
    return wrong


def _docs() -> dict[str, str]:
    return {doc: Path(REPO, doc).read_text() for doc in {c.doc for c in CLAIMS}}


def test_every_quoted_figure_is_the_cell_or_line_of_the_results_it_cites() -> None:
    assert len(CLAIMS) >= 30
    assert mismatches(_docs(), _sources()) == []


def test_a_figure_changed_by_hand_or_found_elsewhere_in_the_section_fails() -> None:
    """The check can fail: one README figure changed; a "0" the section holds elsewhere does not pass for a cell."""
    docs, sources = _docs(), _sources()
    changed = dict(docs, **{"README.md": docs["README.md"].replace("2.121 s vs 51.052 s", "2.121 s vs 51.05 s")})
    assert mismatches(changed, sources) == []  # fewer digits, rounded: the same figure
    changed["README.md"] = docs["README.md"].replace("2.121 s vs 51.052 s", "2.121 s vs 50.052 s")
    assert mismatches(changed, sources) == [
        "README.md, 'node loss' quotes '50.052' where transition.py --only-node-lost prints '51.052' "
        "(cell 'torchrun restart-all + reload + redo' of the row {'rendezvous': 'defaults'})"]
    changed["README.md"] = docs["README.md"].replace("0 survivors restarted", "2 survivors restarted")
    assert any("quotes '2' where transition.py --only-hang prints '0'" in m for m in mismatches(changed, sources))
    changed["README.md"] = docs["README.md"].replace("| 2.121 s vs", "| 9 nodes, 2.121 s vs")
    assert any("figures no claim checks: ['9']" in m for m in mismatches(changed, sources))
    changed = dict(docs, **{"docs/slurm.md": docs["docs/slurm.md"].replace("3.74 s (3.51", "3.7 s (3.51")})
    assert mismatches(changed, sources) == []
    changed["docs/slurm.md"] = docs["docs/slurm.md"].replace("3.74 s (3.51", "3.72 s (3.51")
    assert len(mismatches(changed, sources)) == 1


def test_a_quoted_figure_is_the_printed_one_with_as_many_digits_or_fewer() -> None:
    assert same("2.4", "2.421") and same("2.42", "2.421") and same("10.7", "10.745") and same("2,402", "2402")
    assert same("-5.2", "\u22125.2") and same("not met", "NOT met")
    assert not same("2.5", "2.421") and not same("2.4210", "2.421") and not same("1", "0.4")
    assert not same("met", "NOT met")


def test_the_scale_report_in_results_is_what_the_results_file_prints() -> None:
    """RESULTS.md's scale block is ``python benchmarks/scale.py --report``'s output for the tree's file."""
    body = _results_sections()["scale.py --report"]
    block = re.search(r"```text\n(.*?)```", body, re.S)
    assert block, "no scale report in RESULTS.md"
    printed = [row for row in block.group(1).splitlines() if not row.startswith("wrote benchmarks/")]
    assert printed == _scale_report().splitlines()


# -- the scale results file: keyed by what a run depends on ------------------------------------------------
def test_scale_runs_at_another_ttl_or_commit_are_kept_beside_each_other(tmp_path: Path, monkeypatch) -> None:
    import scale

    monkeypatch.setattr(scale, "RESULTS", tmp_path / "scale_results.json")
    base = {"label": "after", "etcd": "one", "scenario": "join", "n": 256, "ttl": 2, "commit": "abc1234",
            "date": "2026-11-27", "machine": "x", "command": "c", "result": {"n": 256}}
    scale._save(base)
    scale._save({**base, "ttl": 5})
    scale._save({**base, "commit": "def5678"})
    scale._save({**base, "etcd": "three"})
    scale._save({**base, "result": {"n": 256, "again": True}})  # the same run again: replaces its entry
    runs = scale._load()["runs"]
    assert [(r["ttl"], r["commit"], r["etcd_members"]) for r in runs] == [
        (5, "abc1234", 1), (2, "def5678", 1), (2, "abc1234", 3), (2, "abc1234", 1)]
    assert runs[-1]["result"] == {"n": 256, "again": True}


def test_an_entry_that_did_not_record_its_ttl_reads_as_not_recorded() -> None:
    import _scale_report as report
    import scale

    old = {"label": "before", "etcd": "one", "scenario": "steady", "n": 16, "commit": "?", "date": "d",
           "machine": "m", "command": "python benchmarks/scale.py --label before", "result": _steady_result(16)}
    entry = scale.migrate(old)
    assert entry["ttl"] is None and entry["etcd_members"] == 1
    assert scale.run_key(old) != scale.run_key({**old, "ttl": 2})
    data = {"runs": [entry]}
    assert report.steady_rows(data)[0][3] == "?" and report.loss_rows(data)[0][3] == "?"
    assert report.extrapolate(data, 10_000, 1_000) == {}  # no model from a run of unknown TTL
    in_file = [r for r in scale._load()["runs"] if r["label"] == "before"]
    assert in_file and all(r["ttl"] is None for r in in_file)


# -- verdicts: each can say met and NOT met; NOT met exits 1 ------------------------------------------------
def test_the_shared_verdicts_say_met_and_not_met_and_make_the_exit_code() -> None:
    from _targets import MET, NOT_MET, Verdicts, at_least, at_most

    assert (at_most(1.0, 2.0), at_most(3.0, 2.0), at_most(None, 2.0), at_most(math.nan, 2.0)) == \
        (MET, NOT_MET, NOT_MET, NOT_MET)
    assert (at_least(12.0, 10.0), at_least(9.0, 10.0)) == (MET, NOT_MET)
    verdicts = Verdicts()
    verdicts.note("a", MET)
    assert verdicts.exit_code() == 0
    verdicts.note("b", NOT_MET + ", by less than the noise")
    assert verdicts.exit_code() == 1 and verdicts.missed == ["b"]


def _printed(fn: Callable[[], object]) -> tuple[object, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        got = fn()
    return got, out.getvalue()


def test_slurm_prints_not_met_and_exits_1_when_a_stall_misses_its_target() -> None:
    import slurm

    assert slurm.lost_verdict([(2.6, 0), (2.3, 0), (2.4, 0)]) == (2.4, "met")
    assert slurm.lost_verdict([(3.7, 0), (3.5, 0), (3.8, 0)]) == (3.7, "NOT met")
    drain, warned = [(0.39, 0.96, 0.64)], [(0.42, 10.7, 5, 5)]
    code, out = _printed(lambda: slurm.summary({"lost-follower": [(2.4, 0)], "drain": drain, "warning": warned}, 1))
    assert code == 0 and "target <= TTL + 1 = 3 s: met;" in out and "NOT met" not in out
    code, out = _printed(lambda: slurm.summary({"lost-follower": [(2.4, 0)], "lost-leader": [(3.7, 0)]}, 1))
    assert code == 1 and "lost-leader    kill -> survivors' next step   3.700 s   target <= TTL + 1 = 3 s: NOT met" \
        in out
    code, out = _printed(lambda: slurm.summary({"warning": [(0.42, 10.7, 5, 6)]}, 1))
    assert code == 1 and "checkpoint's next: NO" in out


def test_coordinator_prints_not_met_and_exits_1_when_event_to_plan_is_slow() -> None:
    import coordinator

    code, out = _printed(lambda: coordinator.print_event_to_plan([0.009] * 40, 40, 0))
    assert code == 0 and "(target: median <= 100 ms: met)" in out
    code, out = _printed(lambda: coordinator.print_event_to_plan([0.2] * 40, 40, 0))
    assert code == 1 and "(target: median <= 100 ms: NOT met)" in out


def test_detection_verdicts_say_met_and_not_met() -> None:
    import detection

    assert detection.latency_verdict([0.005, 0.004, 0.006], 0.3) == "met"
    assert detection.latency_verdict([0.5, 0.4, 0.6], 0.3) == "NOT met"
    assert detection.latency_verdict([0.005, None, 0.006], 0.3) == "NOT met"  # a fault not detected in one run
    assert (detection.alarms_verdict(0, 0), detection.alarms_verdict(1, 0), detection.alarms_verdict(0, 1)) == \
        ("met", "NOT met", "NOT met")


def test_planner_verdicts_say_met_and_not_met() -> None:
    import planner

    assert planner.solve_verdicts(0.0078, 125) == ("met", "met")
    assert planner.solve_verdicts(0.060, 90) == ("NOT met", "NOT met")
    assert (planner.lookup_verdict(2.7e-6), planner.lookup_verdict(2e-3)) == ("met", "NOT met")


def test_noisy_neighbour_verdict_says_met_and_not_met() -> None:
    import noisy_neighbour

    assert (noisy_neighbour.runs_verdict(0), noisy_neighbour.runs_verdict(1)) == ("met", "NOT met")
    good = {"code": 0, "verdicts": [], "restarts": 0, "trained": True}
    assert noisy_neighbour.passed(good) and not noisy_neighbour.passed({**good, "verdicts": ["task_hang@1"]})


def test_etcd_failover_exits_1_when_a_victims_target_is_not_met() -> None:
    import etcd_failover

    def outcome(seconds: float | None, failures: tuple[str, ...] = ()) -> etcd_failover.Outcome:
        return etcd_failover.Outcome("x", 0.1, seconds, {"longest_s": 0.5}, {"lease lapses": 0}, failures)

    assert etcd_failover.step_verdict([outcome(1.4), outcome(1.3), outcome(1.5)]) == (1.4, "met")
    assert etcd_failover.step_verdict([outcome(1.4), outcome(None)]) == (None, "NOT met")
    code, out = _printed(lambda: etcd_failover.summary({"in use": [outcome(1.4)]}))
    assert code == 0 and "(target <= node TTL + 1 = 3 s: met)" in out
    code, out = _printed(lambda: etcd_failover.summary({"in use": [outcome(1.4)], "leader": [outcome(5.4)]}))
    assert code == 1 and "3 s: NOT met (a known limit" in out
    code, out = _printed(lambda: etcd_failover.summary({"in use": [outcome(1.4, ("lease lapsed",))]}, pinned=True))
    assert code == 1 and "the job did not ride out the loss: in use: lease lapsed" in out


def test_transition_prints_not_met_and_exits_1_for_every_section() -> None:
    import transition

    assert (transition.overhead_verdict(1.9), transition.overhead_verdict(4.0)) == ("met", "NOT met")
    assert (transition.speedup_verdict(17.4), transition.speedup_verdict(3.4)) == ("met", "NOT met")
    assert (transition.ttl_verdict(2.1), transition.ttl_verdict(3.2)) == ("met", "NOT met")
    missed, out = _printed(lambda: transition.print_torch_level([0.05], [4.0], [0.0062], [0.0067], 1, 256))
    assert missed == [] and "target >= 10x: met" in out
    assert _printed(lambda: transition.print_torch_level([1.0], [4.0], [0.0062], [0.0067], 1, 256))[0]
    free = {"ddp": [[0.034]], "unicron": [[0.032]], "unicron float64": [[0.040]]}
    assert _printed(lambda: transition.print_lightning(free, {"unicron": [0.3], "ddp": [5.1]}, 1, 128))[0] == []
    slower = dict(free, unicron=[[0.040]])
    missed, out = _printed(lambda: transition.print_lightning(slower, {"unicron": [0.3], "ddp": [5.1]}, 1, 128))
    assert len(missed) == 1 and "target <= 2%: NOT met" in out
    cpu = {w: {part: [1.0] for part in transition.CPU_PARTS} for w in ("unicron", "plain")}
    assert _printed(lambda: transition.print_tp({"unicron": [[0.395]], "plain": [[0.400]]}, cpu, 1, 256, 4))[0] == []
    assert _printed(lambda: transition.print_tp({"unicron": [[0.408]], "plain": [[0.392]]}, cpu, 1, 256, 4))[0]
    missed, out = _printed(lambda: transition.print_node_lost_rows(
        {"defaults": [(2.1, 51.0)], "fast keep-alive": [(2.5, 8.5)]}, 1))
    assert missed == ["node lost, fast keep-alive: speed-up 3.4x"] and out.count("NOT met") == 1
    assert _printed(lambda: transition.exit_code(missed)) == (1, f"NOT met: {missed[0]}\n")
    assert _printed(lambda: transition.exit_code([])) == (0, "")


def test_snapshot_prints_not_met_and_exits_1_even_within_the_noise() -> None:
    import snapshot

    assert snapshot.noisy_verdict(-0.01, 0.1) == "met"
    assert snapshot.noisy_verdict(0.01, 0.1) == "NOT met, by less than this machine's spread between blocks"
    assert snapshot.noisy_verdict(0.5, 0.1) == "NOT met"
    off = [(0.90, 0.90)] * 40
    on = [(0.90, 0.90)] * 40
    code, out = _printed(lambda: snapshot.report([0.062] * 8, on, off, [(0.95, 0.95)] * 4, [0.066] * 4))
    assert code == 0 and "blocked in save() 66 ms: met" in out
    code, out = _printed(lambda: snapshot.report([0.062] * 8, on, off, [(0.95, 0.95)] * 4, [0.3] * 4))
    assert code == 1 and "blocked in save() 300 ms: NOT met" in out


def test_gpu_prints_not_met_and_exits_1_when_a_ratio_misses_or_a_run_failed() -> None:
    gpu = pytest.importorskip("gpu")

    def steps(ms: float) -> list[tuple[int, float, float]]:
        return [(s, ms / 1e3, ms / 1e3) for s in range(7, 30)]

    rows = {"32-true": {"ddp": [steps(429.0)], "unicron": [steps(416.0)]}}
    missed, out = _printed(lambda: gpu.print_table(rows, {"32-true": {}}))
    assert missed == [] and "pooled met, best runs met" in out
    rows = {"32-true": {"ddp": [steps(400.0)], "unicron": [steps(440.0)]}}
    missed, out = _printed(lambda: gpu.print_table(rows, {"32-true": {}}))
    assert missed == ["32-true pooled", "32-true best runs"] and "pooled NOT met, best runs NOT met" in out
    missed, out = _printed(lambda: gpu.print_table({"16-mixed": {"ddp": [], "unicron": []}},
                                                   {"16-mixed": {"unicron": "exit 1"}}))
    assert missed and "unicron failed: NOT met" in out


def _steady_result(n: int, writes: float = 0.0, p99: float = 1.9, saw: int | None = None) -> dict:
    survivors = n - 1
    return {"n": n, "formed_s": 2.0,
            "steady": {"seconds": 20.0, "per_node_per_s": {"keepalive": 3.8, "range": 0.5},
                       "bytes_per_node_per_s_total": 500.0, "requests_per_s": 4.3 * n + 10.6, "writes_per_s": 2.0,
                       "writes_per_node_per_s": writes + 2.0 / n,
                       "by_role_per_s": {"coordinator:txn": 2.0, "coordinator:range": 5.0,
                                         "coordinator:keepalive": 1.6, "daemon:txn": writes * n}},
            "loss": {"survivors": survivors, "saw_it": survivors if saw is None else saw, "p50_s": p99,
                     "p99_s": p99, "max_s": p99, "watch_events": n + 2, "writes": n + 10, "by_family": {}}}


def _scale_data(**change: object) -> dict:
    """Synthetic ``after`` runs meeting every target; ``change`` misses one (keys: the verdict's name)."""
    entry = {"label": "after", "etcd": "one", "ttl": 2, "commit": "abc1234", "date": "d", "machine": "m"}
    steady_writes = change.get("steady_writes", 0.0)
    runs = [{**entry, "scenario": "steady", "n": n, "result": _steady_result(n, steady_writes if n == 64 else 0.0,
                                                                                change.get("loss_p99", 1.9))}
            for n in (16, 64)]
    runs.append({**entry, "scenario": "plan", "n": 2048,
                 "result": {"n": 2048, "tasks": 100, "median_s": change.get("plan_s", 0.041), "p99_s": 0.07,
                            "coordinator_median_s": 0.043, "plan_bytes": 1, "state_bytes": 1, "commands_bytes": 1}})
    runs.append({**entry, "scenario": "join", "n": 256, "ttl": 5,
                 "result": {"n": 256, "ranked": 256, "round_s": change.get("round_s", 8.8), "joined": 243,
                            "failed": 1, "all_s": math.nan, "p50_s": 22.0, "rdzv_txns": 199, "rdzv_conflicts": 195,
                            "rdzv_bytes": 1.6e7, "emulation_cores": 1.13, "etcd_cores": 0.27}})
    return {"runs": runs}


@pytest.mark.parametrize("change, verdict", [
    ({}, None), ({"steady_writes": 0.5}, 0), ({"loss_p99": 3.5}, 1), ({"plan_s": 0.150}, 2), ({"round_s": 12.0}, 3),
    ({"round_s": math.nan}, 3)])
def test_each_scale_verdict_says_met_and_not_met(change: dict, verdict: int | None) -> None:
    import _scale_report as report

    said = [v for _, v, _ in report.verdicts(_scale_data(**change), 10_000, 1_000)]
    assert said == ["met" if i != verdict else "NOT met" for i in range(4)], said
    if verdict == 3:  # the emulation was saturated (1.13 cores): still not met, and said why beside it
        assert "saturated" in report.verdicts(_scale_data(**change), 10_000, 1_000)[3][2]


def test_a_scale_target_not_measured_is_not_met_and_the_report_exits_1() -> None:
    import _scale_report as report
    import scale

    said = [v for _, v, _ in report.verdicts({"runs": []}, 10_000, 1_000)]
    assert said == ["NOT met"] * 4
    data = scale._load()
    assert _printed(lambda: report.report(copy.deepcopy(data), plots=False))[0] == 0
    slow = copy.deepcopy(data)
    last = [r for r in slow["runs"] if r["label"] == "after" and r["scenario"] == "join" and r["n"] == 256][-1]
    last["result"]["round_s"] = 12.0
    code, out = _printed(lambda: report.report(slow, plots=False))
    assert code == 1 and "VERDICT NOT met: 256 nodes joining one run complete their round within 10 s" in out


# -- transition.py --only-hang: the survivors' restarts and lost steps, from the run's own files ------------
def _run_files(out: Path, pids: dict[int, list[int]], steps: dict[int, list[int]], restarted: list[int]) -> None:
    out.mkdir()
    for rank, done in steps.items():
        reports = [{"step": s, "pid": pids[rank][min(i, len(pids[rank]) - 1)], "finished_at": 1.0 + s}
                   for i, s in enumerate(done)]
        (out / f"rank{rank}.json").write_text(json.dumps(reports))
    events = [{"event": "worker_restarted", "rank": rank, "pid": 99} for rank in restarted]
    (out / "node0.log").write_text("not json\n" + "\n".join(json.dumps(e) for e in events) + "\n")
    (out / "node1.log").write_text(json.dumps({"event": "error_event", "rank": 2}) + "\n")


def test_the_hang_rows_count_survivor_restarts_and_lost_steps_from_the_runs_files(tmp_path: Path) -> None:
    from transition import hang_survivors, survivor_checks

    assert hang_survivors(node_fault=False) == [0, 1, 3] and hang_survivors(node_fault=True) == [0, 1]
    clean = tmp_path / "clean"
    _run_files(clean, {0: [10], 1: [11], 3: [13]}, {0: list(range(6)), 1: list(range(6)), 3: list(range(6))}, [2])
    assert survivor_checks(clean, [0, 1, 3], 6) == (0, 0, [])  # rank 2's restart is expected: not a survivor's
    bad = tmp_path / "bad"
    _run_files(bad, {0: [10, 20], 1: [11], 3: [13]}, {0: list(range(6)), 1: [0, 1, 2, 4, 5], 3: [0, 1, 2, 2, 3, 4, 5]},
               [3])
    restarts, lost, problems = survivor_checks(bad, [0, 1, 3], 6)
    assert (restarts, lost) == (2, 2)  # rank 3 restarted by its agent, rank 0 ran as two processes; 3 and 2 again
    assert any("rank 0 ran as 2 processes" in p for p in problems) and any("rank 1 completed" in p for p in problems)
    missing = tmp_path / "missing"
    _run_files(missing, {0: [10]}, {0: list(range(6))}, [])
    assert survivor_checks(missing, [0, 1], 6)[1] == 6  # no report from rank 1: every step of it lost


# -- etcd_failover.py: fails when the store cannot fail over ---------------------------------------------
@pytest.mark.e2e
@pytest.mark.matrix  # (134 s: a check of the benchmark's own failure report, run with -m matrix)
@pytest.mark.timeout(400)
def test_the_etcd_failover_benchmark_fails_saying_why_when_the_store_is_pinned_to_one_endpoint() -> None:
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "etcd_failover.py"), "--runs", "1",
                           "--victim", "in use", "--pin-endpoint"], capture_output=True, text=True, timeout=380,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "checks: FAILED" in done.stdout and "the job did not ride out the loss: in use:" in done.stdout
    assert "lease lapsed" in done.stdout or "the launcher exited" in done.stdout, done.stdout[-3000:]

"""mkdocs hook: the guide pages, made from the guides at build time.

For each `guides/*.py` it adds `guides/<name>.md` to the site: the guide's
docstring as its introduction, what `render_guides.py` kept of its last run
(`guides/_rendered/<name>/`: the printed output, the PNGs, the command, the
backend, the time it took) and its source. `docs/guides/index.md` lists them.

A guide that was never rendered still gets its page, with a warning in the
build log, which `mkdocs build --strict` (CI) turns into a failure: run
`python guides/site_tools/render_guides.py` first.
"""

import ast
import json
import logging
import pathlib
import re

from mkdocs.structure.files import File

log = logging.getLogger(f"mkdocs.plugins.{__name__}")

GUIDES = pathlib.Path(__file__).resolve().parents[1]
RENDERED = GUIDES / "_rendered"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|[\x08\r]")
_LIST_ITEM = re.compile(r"^(\s*)([-*]|\d+\.) ")


_COMMAND = ("python ", "KERAS_BACKEND=", "KERAS_MP_QUICK=")


def _markdown(docstring):
    """A guide's docstring as Markdown: lists get the blank line before them
    that Python-Markdown needs, and the indented command lines become a
    fenced `bash` block (indented, Markdown would read them as a list
    item's continuation)."""
    lines = []
    source = docstring.splitlines()
    i = 0
    while i < len(source):
        line = source[i]
        previous = lines[-1] if lines else ""
        if line.startswith("    ") and line.strip().startswith(_COMMAND):
            block = []
            while i < len(source) and source[i].startswith("    "):
                block.append(source[i][4:])
                i += 1
            if previous.strip():
                lines.append("")
            lines += ["```bash", *block, "```"]
            continue
        if (
            _LIST_ITEM.match(line)
            and not line.startswith("    ")
            and previous.strip()
            and not _LIST_ITEM.match(previous)
            and not previous.startswith(" ")
        ):
            lines.append("")
        lines.append(line)
        i += 1
    return "\n".join(lines)


def _split(path):
    """(title, introduction, source without the docstring) of a guide."""
    source = path.read_text()
    module = ast.parse(source)
    docstring = ast.get_docstring(module) or path.stem
    first, _, rest = docstring.partition("\n")
    title = first.removeprefix("Guide:").strip().rstrip(".")
    title = title[:1].upper() + title[1:]
    body = source.splitlines()[module.body[0].end_lineno :]
    return title, _markdown(rest.strip()), "\n".join(body).strip() + "\n"


def _fence(text, language):
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}{language}\n{text.rstrip()}\n{fence}\n"


def _output(text):
    """The printed output, one block per `## section` line the guide
    printed, each under a heading of its own (in the page's contents)."""
    sections = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    parts = [_fence(sections[0], "text")] if sections[0].strip() else []
    for title, body in zip(sections[1::2], sections[2::2]):
        parts.append(f"### {title.strip()}\n")
        if body.strip():
            parts.append(_fence(body.strip("\n"), "text"))
    return parts


def _run_note(record):
    mode = (
        "with `KERAS_MP_QUICK=1` (a few steps per section: the numbers are "
        "those of a short run, not of the full guide)"
        if record["quick"]
        else "in full (the guide's default step counts)"
    )
    versions = ", ".join(f"{k} {v}" for k, v in record["versions"].items())
    cpu = record.get("cpu_seconds")
    load = record.get("load_average")
    took = f"took {record['seconds']:.0f} s"
    if cpu is not None:
        took += f" ({cpu:.0f} s of CPU time"
        took += f", load average {load:g} at its start)" if load else ")"
    return (
        '!!! info "The run below"\n'
        f"    `{record['command']}`, run {mode}, {took} "
        f"on {record['date']} ({record['machine']}; {versions}). The "
        "sections that depend on the backend ran on "
        f"{record['backend']}: run it with another `KERAS_BACKEND` to see "
        "theirs.\n"
    )


def _page(path):
    title, intro, code = _split(path)
    rendered = RENDERED / path.stem
    parts = [f"# {title}\n", intro + "\n"]
    run = rendered / "run.json"
    plots = []
    if run.exists():
        record = json.loads(run.read_text())
        output = _ANSI.sub("", (rendered / "output.txt").read_text())
        plots = [rendered / name for name in record["plots"]]
        parts += [_run_note(record), "## Output\n", *_output(output)]
        for plot in plots:
            if not plot.exists():
                log.warning(f"{plot} is listed in {run} but missing.")
                continue
            parts.append(f"![{plot.stem}]({path.stem}/{plot.name})\n")
    else:
        log.warning(
            f"guides/{path.name} has no rendered output in {rendered}: run "
            f"python guides/site_tools/render_guides.py {path.stem}"
        )
        parts.append(
            '!!! warning "Not rendered"\n    Run `python guides/site_tools/'
            f"render_guides.py {path.stem}` and build again.\n"
        )
    parts += ["## Source\n", f"`guides/{path.name}`:\n", _fence(code, "python")]
    return title, "\n".join(parts), [p for p in plots if p.exists()]


def on_files(files, config):
    for path in sorted(GUIDES.glob("*.py")):
        title, page, plots = _page(path)
        files.append(
            File.generated(config, f"guides/{path.stem}.md", content=page)
        )
        for plot in plots:
            files.append(
                File.generated(
                    config,
                    f"guides/{path.stem}/{plot.name}",
                    abs_src_path=str(plot),
                )
            )
    return files

"""griffe extension: keras_mp's doctest examples as code blocks.

keras_mp's docstrings write their examples as bare doctests after an
`Example:` line (`tests/public_api_test.py` runs them), not indented under
it as Google-style sections are. Unchanged, Markdown would read their output
as prose (`[0.6, 0.8]` as a link). This wraps each run of doctest lines, with
the output lines up to the next blank line, in a `pycon` fence.
"""

import griffe


def fence_doctests(text):
    """`text` with each doctest block in a ```pycon fence."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        block = []
        while i < len(lines) and lines[i].strip():
            block.append(lines[i].removeprefix(indent))
            i += 1
        out += [
            f"{indent}```pycon",
            *(indent + b for b in block),
            f"{indent}```",
        ]
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        docstring = obj.docstring
        if docstring is not None and ">>>" in docstring.value:
            docstring.value = fence_doctests(docstring.value)

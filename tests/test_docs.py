"""The docs cite what exists and say what is true of the code: every repository path named in README.md,
BENCHMARKS.md and docs/*.md (tests/..., src/..., scripts/..., examples/..., benchmarks/..., docs/...) and every
relative markdown link resolves, and so does every link's `#anchor` (a heading of the target file); every config
key the docs name (`train.lora.rank`, `rollout.engine: vllm`, `algo.kl_coef=0.1`, a YAML block of config) exists
in the schema; every config field has its docstring; every command is in docs/cli.md and every `asyncflow` command
line of a shell block parses; the README stays a newcomer's page."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel

from asyncflow.config import Config

ROOT = Path(__file__).resolve().parents[1]
# docs/benchmark-log.md is history: it names files as they were when it was measured
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md",
        *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmark-log.md")]
PATH = re.compile(r"(?<![\w/.-])((?:tests|src|scripts|examples|benchmarks|docs)/[\w./-]*\w)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
ANCHOR_LINK = re.compile(r"\]\(([^)#\s]*)#([^)\s]*)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
SECTIONS = tuple(Config.model_fields)  # run, model, data, reward, rollout, ...
# a dotted key: a section, then fields (`.*`: all of them); not part of a longer name (`config.train`, `x/run.py`),
# not a method call (`run.save()`)
KEY = re.compile(rf"(?<![\w./$-])((?:{'|'.join(SECTIONS)})(?:\.(?:\w+|\*))+)(?![\w(.])")
OVERRIDE = re.compile(rf"(?<![\w./$-])((?:{'|'.join(SECTIONS)})(?:\.\w+)+)=")  # `section.key=value` in a command
FILE_SUFFIXES = {"py", "md", "pt", "safetensors", "json", "jsonl", "yaml", "yml", "png", "txt", "log", "jinja", "sh"}
# dotted names in the docs that are deliberately not keys of the schema, each with its reason
NOT_KEYS = {
    "train.lrr": "the misspelt key of an example error message (docs/cli.md)",
    "model.load_weights": "a method of vLLM's model (docs/vllm-weights.md), not a config key",
}


def cited(doc: Path) -> list[tuple[str, Path]]:
    text = doc.read_text()
    paths = [(p, ROOT / p) for p in PATH.findall(text) if "*" not in p]
    links = [(p, (doc.parent / p)) for p in LINK.findall(text) if not p.startswith(("http://", "https://"))]
    return paths + links


def test_every_cited_path_exists():
    missing = [f"{doc.relative_to(ROOT)}: {name}" for doc in DOCS for name, path in cited(doc)
               if not path.resolve().exists() and not path.with_suffix("").exists()]
    assert not missing, "cited but missing:\n" + "\n".join(missing)


# --- anchors -------------------------------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor of a heading: links reduced to their text, lower case, punctuation dropped (backticks, dots,
    slashes, parentheses ...; `-` and `_` kept), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown text's headings (outside code blocks); a repeated one gets -1, -2, ... as on
    GitHub."""
    seen: dict[str, int] = {}
    for line in FENCE.sub("", text).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            seen[base if base not in seen else f"{base}-{seen[base]}"] = 0
            seen[base] = seen.get(base, 0) + 1
    return set(seen)


def broken_anchors(doc: Path, text: str) -> list[str]:
    broken = []
    for target, anchor in ANCHOR_LINK.findall(text):
        if target.startswith(("http://", "https://")):
            continue
        path = (doc.parent / target) if target else doc
        if path.suffix != ".md" or not path.exists():
            continue  # a missing file is test_every_cited_path_exists's to report
        if anchor not in anchors(text if path == doc else path.read_text()):
            broken.append(f"{target}#{anchor}")
    return broken


def test_slugs_are_githubs():
    assert slug("On-policy distillation on the main job (`benchmarks/distill_curves.py`)") == \
        "on-policy-distillation-on-the-main-job-benchmarksdistill_curvespy"
    assert slug("bf16 and activation checkpointing; the GPU check (`scripts/gpu_check.sh`)") == \
        "bf16-and-activation-checkpointing-the-gpu-check-scriptsgpu_checksh"
    assert anchors("# A\n## B c\n```\n# not a heading\n```\n## B c\n") == {"a", "b-c", "b-c-1"}


def test_a_link_to_a_missing_heading_is_found(tmp_path):
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Title\n\n## The main job\n")
    text = "[x](b.md#the-main-job) [y](#title-here) [z](b.md#no-such-section)\n\n# Title here\n"
    assert broken_anchors(doc, text) == ["b.md#no-such-section"]


def test_every_anchor_resolves():
    broken = [f"{doc.relative_to(ROOT)}: {link}" for doc in DOCS for link in broken_anchors(doc, doc.read_text())]
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)


# --- config keys ---------------------------------------------------------------------------------------------------

def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def has_key(model: type[BaseModel], dotted: str) -> bool:
    """`dotted` (`lora.rank`) names a field of `model`, through nested models, and through Optional / Union / list /
    dict of models; any key below a free-form dict (`dict[str, Any]`) exists."""
    name, _, rest = dotted.partition(".")
    field = model.model_fields.get(name)
    return field is not None and (not rest or _within(field.annotation, rest))


def _within(annotation: Any, rest: str) -> bool:
    if _is_model(annotation):
        return has_key(annotation, rest)
    if get_origin(annotation) is dict:
        value = get_args(annotation)[1]
        deeper = rest.partition(".")[2]  # the first segment is the mapping's own key
        return value is Any or not deeper or _within(value, deeper)
    return any(_within(arg, rest) for arg in get_args(annotation))  # Optional, Union, list, Annotated


def named_keys(text: str) -> set[str]:
    """The config keys a markdown text names: dotted keys of a Config section in code spans (`train.lora.rank`,
    `rollout.engine: vllm`, `--set algo.kl_coef=0.1`, `algo.critic.*`, file names such as `model.safetensors` left
    out), `section.key=value` overrides in code blocks, and the keys of a YAML code block of config."""
    keys: set[str] = set()
    for language, block in FENCE.findall(text):
        keys |= set(OVERRIDE.findall(block))
        tree = yaml.safe_load(block) if language == "yaml" else None
        if isinstance(tree, dict) and set(tree) <= set(SECTIONS):
            keys |= set(_yaml_keys(tree))
    for _, span in CODE_SPAN.findall(FENCE.sub("", text)):
        for key in KEY.findall(span):
            key = key.removesuffix(".*")
            if not (key.count(".") == 1 and key.split(".")[1] in FILE_SUFFIXES):
                keys.add(key)
    return keys


def _yaml_keys(tree: Any, prefix: str = ""):
    if isinstance(tree, dict):
        for name, value in tree.items():
            yield f"{prefix}{name}"
            yield from _yaml_keys(value, f"{prefix}{name}.")
    elif isinstance(tree, list):
        for item in tree:
            yield from _yaml_keys(item, prefix)


def unknown_keys(text: str) -> list[str]:
    return sorted(k for k in named_keys(text) if k not in NOT_KEYS and not has_key(Config, k))


def test_the_key_checker_finds_a_key_that_does_not_exist():
    text = """Set `algo.no_such_key`, `train.lora.rank: 8`, `--set algo.kl_coef=0.1` and `algo.critic.*`; the file
`model.safetensors`, the attribute `config.train`, the call `run.save()`, the metric `env/tool_timeouts`.

```bash
asyncflow train x.yaml rollout.group_size=4 rollout.no_such=1
```

```yaml
reward:
  fns:
    - kind: judge
      base_url: http://x/v1
      no_such_judge_key: 1
data:
  task_options: {min_terms: 2}
```
"""
    assert named_keys(text) == {
        "algo.no_such_key", "train.lora.rank", "algo.kl_coef", "algo.critic", "rollout.group_size", "rollout.no_such",
        "reward", "reward.fns", "reward.fns.kind", "reward.fns.base_url", "reward.fns.no_such_judge_key", "data",
        "data.task_options", "data.task_options.min_terms",
    }
    assert unknown_keys(text) == ["algo.no_such_key", "reward.fns.no_such_judge_key", "rollout.no_such"]


def test_every_config_key_named_in_the_docs_exists():
    unknown = [f"{doc.relative_to(ROOT)}: {key}" for doc in DOCS for key in unknown_keys(doc.read_text())]
    assert not unknown, "config keys the schema does not have:\n" + "\n".join(unknown)


def test_the_allowed_names_are_still_named_and_still_not_keys():
    named = set().union(*(named_keys(doc.read_text()) for doc in DOCS))
    assert all(key in named and not has_key(Config, key) for key in NOT_KEYS), NOT_KEYS


def undocumented(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Fields of `model` (dotted, through nested models in any annotation) without a docstring; a field that is a
    section (a model alone: `train.lora` is documented by its own fields) needs none."""
    missing = []
    for name, field in model.model_fields.items():
        if not _is_model(field.annotation) and not (field.description or "").strip():
            missing.append(prefix + name)
        for inner in _models(field.annotation):
            missing += undocumented(inner, f"{prefix}{name}.")
    return missing


def _models(annotation: Any) -> list[type[BaseModel]]:
    if _is_model(annotation):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models(arg)]


def test_the_docstring_checker_finds_an_undocumented_field():
    from pydantic import ConfigDict

    class Inner(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)
        good: int = 0
        """Documented."""
        bad: int = 0

    class Outer(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)
        section: Inner = Inner()
        entries: list[Inner | str] = []
        """Entries."""
        plain: str = ""

    assert undocumented(Outer) == ["section.bad", "entries.bad", "plain"]


def test_every_config_field_has_a_docstring():
    """The reference of every key is its docstring in src/asyncflow/config.py (docs/configuration.md points there):
    every field, `reward.fns`' judge entries and `stages`' fields included."""
    assert not undocumented(Config), f"config fields without a docstring: {undocumented(Config)}"


# --- commands, README ----------------------------------------------------------------------------------------------

def test_every_command_is_in_the_cli_doc():
    from asyncflow.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    usage = FENCE.search((ROOT / "docs" / "cli.md").read_text()).group(2)
    missing = [name for name in commands if not re.search(rf"^asyncflow {name}\b", usage, re.M)]
    assert not missing, f"commands missing from docs/cli.md's usage block: {missing}"


def shell_commands(text: str) -> list[list[str]]:
    """The arguments of each `asyncflow ...` command line in a markdown text's shell code blocks (continuation lines
    joined; a synopsis with `[optional]` or `<placeholder>` parts left out)."""
    commands = []
    for language, block in FENCE.findall(text):
        if language not in ("bash", "sh", ""):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#", line)[0]
            command = re.search(r"(?:^|[\s/])asyncflow\s+([^&]*)", line)
            if command and not re.search(r"[\[<]", line):
                commands.append(shlex.split(command.group(1)))
    return commands


def parse_error(argv: list[str]) -> str | None:
    """What `asyncflow` would refuse in `argv` before doing anything (as `asyncflow.cli.main` parses), or None."""
    from asyncflow.cli import build_parser

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            _, extra = build_parser().parse_known_args(argv)
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    return f"unrecognized arguments: {' '.join(unknown)}" if unknown else None


def test_the_command_checker_finds_an_unknown_flag():
    text = "```bash\nasyncflow train --config my.yaml train.lr=1 \\\n  --threads 1   # a comment\n```\n"
    assert shell_commands(text) == [["train", "--config", "my.yaml", "train.lr=1", "--threads", "1"]]
    assert parse_error(shell_commands(text)[0]) == "unrecognized arguments: --config"
    assert parse_error(["train", "my.yaml", "train.lr=1", "--threads", "1"]) is None
    assert "is not a TCP port" in parse_error(["serve", "preset:tiny-llama", "--port", "80x"])


def test_every_command_in_the_docs_parses():
    refused = [f"{doc.relative_to(ROOT)}: asyncflow {' '.join(argv)}: {error}" for doc in DOCS
               for argv in shell_commands(doc.read_text()) if (error := parse_error(argv))]
    assert not refused, "commands asyncflow refuses:\n" + "\n".join(refused)


def test_readme_is_a_newcomers_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200, "deep sections belong in docs/"
    for command in ("bash scripts/train.sh", "bash scripts/test.sh"):
        assert command in readme


# a section named by its quoted title: `README ("Title")`, `BENCHMARKS.md, "Title"`, `see "Title" in [x](file.md)`,
# `see "Title"` or `"Title" below` (a section of the same file)
QUOTED_ELSEWHERE = re.compile(r'\b(README|BENCHMARKS)(?:\.md)?[,(\s]{1,3}"([^"]+)"')
QUOTED_IN_LINKED = re.compile(r'\b[Ss]ee "([^"]+)" in \[[^\]]*\]\(([^)#\s]+)\)')
QUOTED_HERE = re.compile(r'\b[Ss]ee "([^"]+)"(?! in \[)|"([^"]+)" (?:below|above)\b')


def missing_sections(doc: Path, text: str) -> list[str]:
    """Quoted section titles that no heading of the file they point into starts with."""
    named = [(ROOT / f"{name}.md", title) for name, title in QUOTED_ELSEWHERE.findall(text)]
    named += [((doc.parent / target), title) for title, target in QUOTED_IN_LINKED.findall(text)]
    named += [(doc, a or b) for a, b in QUOTED_HERE.findall(text)]
    missing = []
    for path, title in named:
        source = text if path == doc else path.read_text()
        headings = [re.sub(r"\s+", " ", h.replace("`", "")) for h in
                    re.findall(r"^#{1,6}\s+(.*?)\s*$", FENCE.sub("", source), re.M)]
        if not any(h.startswith(re.sub(r"\s+", " ", title)) for h in headings):
            missing.append(f"{path.name}: \"{title}\"")
    return missing


def test_the_section_checker_finds_a_quoted_title_that_is_no_heading():
    text = """# Doc\n\n## Limits\n\nSee "Limits" and "Limits" below; "Reliability" below; README ("The main job") and
README ("Workflows and\nspeed"); BENCHMARKS.md, "No such benchmark"; see "Limits" in [a](cli.md).\n"""
    assert missing_sections(ROOT / "docs" / "x.md", text) == [
        'README.md: "Workflows and\nspeed"', 'BENCHMARKS.md: "No such benchmark"', 'cli.md: "Limits"',
        'x.md: "Reliability"']


def test_every_section_named_by_its_title_exists():
    missing = [f"{doc.relative_to(ROOT)}: {m}" for doc in DOCS for m in missing_sections(doc, doc.read_text())]
    assert not missing, "sections named but not there (link to them instead):\n" + "\n".join(missing)

"""The configuration reference in the README is generated from the config models and kept current; `dflash config`
prints the config a command would use."""

from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import Field, PositiveInt

from dflash_app import cli
from dflash_app.config import load_config
from dflash_app.config_doc import END, START, default_text, main, reference, type_text, with_reference
from dflash_core.config import PipelineConfig, parse_config
from dflash_core.schema import StrictModel

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_reference_is_current():
    """Fails when a config key, default or description changed without `python -m dflash_app.config_doc --write
    README.md`."""
    assert main(["--check", str(README)]) == 0


def test_every_key_of_every_section_is_described():
    def keys(model, prefix=""):
        for name, field in model.model_fields.items():
            section = field.annotation
            if isinstance(section, type) and issubclass(section, StrictModel):
                yield from keys(section, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", field

    undescribed = [key for key, field in keys(PipelineConfig) if not field.description]
    assert undescribed == []
    text = reference()
    assert all(f"| `{key}` |" in text for key, _ in keys(PipelineConfig))


def test_types_and_defaults_read_as_a_user_writes_them():
    class Section(StrictModel):
        """A section."""

        mode: Literal["auto", "keep"] = Field("auto", description="a | b")
        size: PositiveInt = 8
        limit: PositiveInt | None = None
        names: list[str] = Field(default_factory=list)
        pair: tuple[float, float] = (0.9, 0.95)
        roles: dict[str, str] = Field(default_factory=dict)
        share: float = Field(0.5, ge=0.0, lt=1.0)
        confidence: float | None = Field(None, gt=0.5, lt=1.0)
        target: str

    fields = Section.model_fields
    assert [type_text(f.annotation, f.metadata) for f in fields.values()] == [
        "auto | keep", "int > 0", "int > 0 or null", "list of str", "[float, float]", "mapping str -> str",
        "float >= 0.0, < 1.0", "float > 0.5, < 1.0 or null", "str"]
    assert [default_text(f) for f in fields.values()] == [
        '"auto"', "8", "null", "[]", "[0.9, 0.95]", "{}", "0.5", "null", "required"]

    class Root(StrictModel):
        section: Section

    assert "| `section.mode` | auto \\| keep | \"auto\" | a \\| b |" in reference(Root)


def test_a_stale_reference_is_found_and_rewritten(tmp_path, capsys):
    page = tmp_path / "README.md"
    page.write_text(f"# title\n\n{START}\nold\n{END}\n\nafter\n")
    assert main(["--check", str(page)]) == 1
    assert "config_doc --write" in capsys.readouterr().err
    assert main(["--write", str(page)]) == 0
    assert main(["--check", str(page)]) == 0
    assert page.read_text().endswith(f"{END}\n\nafter\n") and "| `data.source` |" in page.read_text()
    with pytest.raises(SystemExit, match="no block"):
        with_reference("# a page without the markers\n")


def test_dflash_config_prints_the_config_with_overrides_and_defaults(capsys):
    assert cli.main(["config", "--set", "train.lr=0.001", "--set", "data.same_role_turns=merge"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert parse_config(printed) == load_config("tiny-cpu", {"train.lr": 0.001, "data.same_role_turns": "merge"})
    assert printed["train"]["lr"] == 0.001 and printed["check"]["spike_k"] == 7.0  # a default filled in
    assert cli.main(["config", "--set", "train.lrr=1"]) == 2
    assert "unknown key 'train.lrr'" in capsys.readouterr().err

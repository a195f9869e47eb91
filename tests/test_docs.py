"""The docs cannot rot: docs/api.md is what scripts/api-docs writes, every public name
has a docstring and an entry there, and docs/migration.md names only what exists."""

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import inspect
import pathlib
import re
import types

import pytest

pytest.importorskip("flax", minversion="0.12", reason="docs/api.md documents oxmoe.flax and oxmoe.nnx (oxmoe[flax])")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_generator():
    loader = importlib.machinery.SourceFileLoader("api_docs", str(ROOT / "scripts" / "api-docs"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("api_docs", loader))
    loader.exec_module(module)
    return module


api_docs = _load_generator()
PUBLIC_NAMES = [(module_name, name) for module_name in api_docs.MODULES
                for name in importlib.import_module(module_name).__all__]

# In docs/migration.md: `oxmoe.x.y`, or `MoEConfig.f` / `MoEParams.f` / `MoEAux.f` for oxmoe.moe's
# classes, optionally followed by a call whose keyword names (`name=`) are checked too.
MENTION = re.compile(r"`((?:oxmoe|MoEConfig|MoEParams|MoEAux)(?:\.\w+)*)(\([^`]*\))?")
SHORT_NAMES = {"MoEConfig": "oxmoe.moe.MoEConfig", "MoEParams": "oxmoe.moe.MoEParams", "MoEAux": "oxmoe.moe.MoEAux"}


def test_api_md_is_what_the_generator_writes():
    assert (ROOT / "docs" / "api.md").read_text() == api_docs.render(), api_docs.OUT_OF_DATE


@pytest.mark.parametrize("module_name, name", PUBLIC_NAMES)
def test_every_public_function_and_class_has_a_docstring(module_name, name):
    obj = getattr(importlib.import_module(module_name), name)
    if callable(obj) or isinstance(obj, types.ModuleType):
        assert api_docs.docstring(obj).strip(), f"{module_name}.{name} has no docstring"


def test_every_public_name_has_an_entry_in_api_md():
    text = (ROOT / "docs" / "api.md").read_text()
    missing = [f"{m}.{n}" for m, n in PUBLIC_NAMES if f"`{m}.{n}`" not in text]
    assert not missing, f"not in docs/api.md: {missing}"


def _resolve(dotted: str):
    """The object a dotted oxmoe name names; a dataclass field resolves to its class."""
    parts = SHORT_NAMES.get(dotted.split(".")[0], dotted.split(".")[0]).split(".") + dotted.split(".")[1:]
    obj = importlib.import_module(parts[0])
    for depth, part in enumerate(parts[1:], 2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif dataclasses.is_dataclass(obj) and part in {f.name for f in dataclasses.fields(obj)}:
            assert depth == len(parts), f"{dotted}: {part} is a field, with nothing under it"
        else:
            raise AssertionError(f"{'.'.join(parts[:depth])} does not exist")
    return obj


def _keywords(obj) -> set[str]:
    function = obj.__init__ if isinstance(obj, type) else obj
    return set(inspect.signature(function).parameters)


def test_every_oxmoe_name_in_migration_md_exists():
    for module_name in api_docs.MODULES:  # oxmoe.flax and oxmoe.nnx are not imported by oxmoe
        importlib.import_module(module_name)
    mentions = MENTION.findall((ROOT / "docs" / "migration.md").read_text())
    assert len(mentions) > 50, "docs/migration.md should name oxmoe's API in backticks"
    for dotted, call in mentions:
        obj = _resolve(dotted)
        unknown = set(re.findall(r"(\w+)=", call)) - _keywords(obj) if call else set()
        assert not unknown, f"`{dotted}{call}`: {sorted(unknown)} are not arguments of {dotted}"

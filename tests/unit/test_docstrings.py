"""Every public function, class and method of procgroup's top-level API has a docstring (issue 10 item 7)."""

from __future__ import annotations

import inspect
from typing import Any, Iterator, Tuple

import pytest

import procgroup


def _own(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").startswith("procgroup")


def _public_api() -> Iterator[Tuple[str, Any]]:
    for name in procgroup.__all__:
        if name.startswith("_"):
            continue
        obj = getattr(procgroup, name)
        if not (inspect.isclass(obj) or callable(obj)) or not _own(obj):
            continue
        yield name, obj
        if inspect.isclass(obj):
            for mname, member in vars(obj).items():
                if mname.startswith("_") or not _own(obj):
                    continue
                fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if inspect.isfunction(fn):
                    yield f"{name}.{mname}", fn


def test_api_is_walked() -> None:
    names = {n for n, _ in _public_api()}
    assert {"all_reduce", "init_process_group", "Work.wait", "Work.get_future", "TCPStore"} <= names


@pytest.mark.parametrize("name", [n for n, _ in _public_api()])
def test_has_docstring(name: str) -> None:
    obj = dict(_public_api())[name]
    doc = inspect.getdoc(obj) if not inspect.isclass(obj) else obj.__dict__.get("__doc__")
    assert doc and doc.strip(), f"procgroup.{name} has no docstring"

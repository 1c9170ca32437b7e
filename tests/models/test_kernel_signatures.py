"""kernels.py's ctypes declarations against the C they call, read from csrc/: ctypes trusts them, so
an argument typed wrongly (an int where C takes an int64_t, a missing one) passes garbage rather
than failing, and a struct field out of place moves every field after it."""

from __future__ import annotations

import ctypes
import re
import tomllib
from pathlib import Path

import pytest
import torch

from tokenmill.models import kernels
from tokenmill.models.quant import (
    BLOCK,
    HALF_BLOCK,
    Q4_OFFSET,
    Q6_OFFSET,
    SUPER_BLOCK,
    ScaleFormat,
    SuperBlockValues,
    pack_super_block_values,
)

CSRC = Path(kernels.__file__).with_name("csrc")
# What kernels.py passes for each C type: every pointer as a void pointer (a tensor's data_ptr()).
SCALARS: dict[str, type] = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}


def _source() -> str:
    """Every csrc/ file, comments and preprocessor lines left out."""
    text = "\n".join(p.read_text() for p in sorted(CSRC.glob("*.[ch]")))
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.DOTALL)
    return re.sub(r"(?m)^\s*#.*$", "", text)


def _ctype(declaration: str, structs: dict[str, type] | None = None) -> type:
    """The ctypes type of `const float *x`, `int64_t window`, `QuantLinear qkv`, ... (the name left out)."""
    if "*" in declaration or "[" in declaration:
        return ctypes.c_void_p
    words = [w for w in declaration.split() if w != "const"]
    base = " ".join(words[:-1])
    known = {**SCALARS, **(structs or {})}
    assert base in known, f"no ctypes type for C type {base!r} ({declaration.strip()!r}): add it to SCALARS"
    return known[base]


def c_prototypes(name: str) -> list[tuple[type, list[type]]]:
    """(restype, argtypes) of each definition of exported function `name` (several under #if branches)."""
    pattern = rf"(?m)^([A-Za-z_][\w \t\*]*?)\b{name}\s*\(([^)]*)\)\s*\{{"
    found = []
    for ret, params in re.findall(pattern, _source()):
        assert "static" not in ret.split(), f"{name} is static: not exported"
        args = [] if params.strip() in ("", "void") else [_ctype(p) for p in params.split(",")]
        found.append((_ctype(f"{ret} {name}"), args))
    return found


def c_struct(name: str, structs: dict[str, type]) -> list[tuple[str, type]]:
    """The fields of `typedef struct [tag] { ... } name;`, in order."""
    match = re.search(rf"typedef\s+struct\s*(?:\w+\s*)?\{{([^}}]*)\}}\s*{name}\s*;", _source())
    assert match, f"no typedef struct {name} in csrc/"
    fields = []
    for statement in filter(str.strip, match.group(1).split(";")):
        first, *more = statement.split(",")  # `const void *weight, *scale, *min`
        base = re.match(r"\s*((?:const\s+)?(?:struct\s+)?\w+)", first)
        assert base
        for declarator in [first[base.end():], *more]:
            field = re.sub(r"[\s*]", "", declarator)
            fields.append((field, _ctype(f"{base.group(1)} {declarator}", structs)))
    return fields


@pytest.mark.parametrize("name", sorted(kernels.SIGNATURES))
def test_each_declared_signature_is_the_c_prototype(name: str) -> None:
    lib = kernels.library()
    assert lib is not None, "the kernels must build where the tests run (gcc is there)"
    fn = getattr(lib, name)
    prototypes = c_prototypes(name)
    assert prototypes, f"{name}: no definition in csrc/"
    for restype, argtypes in prototypes:
        assert fn.restype is restype, f"{name} returns {restype.__name__} in C, {fn.restype} in kernels.py"
        declared, wanted = [t.__name__ for t in fn.argtypes], [t.__name__ for t in argtypes]
        assert declared == wanted, f"{name}: kernels.py declares {declared}, csrc/ takes {wanted}"


STRUCTS = {name: value for name, value in vars(kernels).items()
           if isinstance(value, type) and issubclass(value, ctypes.Structure) and value is not ctypes.Structure}


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_each_struct_has_the_c_fields_in_order(name: str) -> None:
    declared = [(field, t.__name__) for field, t in STRUCTS[name]._fields_]
    wanted = [(field, t.__name__) for field, t in c_struct(name, STRUCTS)]
    assert declared == wanted, f"{name}: kernels.py has {declared}, csrc/ {wanted}"



def test_scale_formats_and_super_blocks_are_those_of_the_c() -> None:
    """quant.py's ScaleFormat, block and super-block sizes and offsets restate team.h's: a mismatch
    would read every scale (or weight) of a layer wrongly."""
    header = (CSRC / "team.h").read_text()
    formats = dict(re.findall(r"SCALES_(\w+) = (\d+)", header))
    assert {f.name: f.value for f in ScaleFormat} == {k: int(v) for k, v in formats.items()}
    defines = dict(re.findall(r"#define (SUPER_BLOCK|Q4_OFFSET|Q6_OFFSET) (\d+)", header))
    assert (int(defines["SUPER_BLOCK"]), int(defines["Q4_OFFSET"]), int(defines["Q6_OFFSET"])) == (
        SUPER_BLOCK, Q4_OFFSET, Q6_OFFSET)
    sub_blocks = re.search(r"#define SUB_BLOCK\(bits\) \(\(bits\) == 6 \? (\d+) : (\d+)\)", header)
    assert sub_blocks is not None and tuple(map(int, sub_blocks.groups())) == (HALF_BLOCK, BLOCK)
    layout = re.search(r"#define SUPER_BLOCK_BYTES\(bits\) \((\d+) \+ (\d+) \* \(SUPER_BLOCK / SUB_BLOCK\(bits\)\)\)",
                       header)
    assert layout is not None
    factor_bytes, bytes_per_sub_block = map(int, layout.groups())
    for sub_block, dtype in ((BLOCK, torch.uint8), (HALF_BLOCK, torch.int8)):
        subs = SUPER_BLOCK // sub_block
        one = SuperBlockValues(torch.ones(8, 1, dtype=torch.float16), torch.ones(8, subs, dtype=dtype))
        assert pack_super_block_values(one).shape[-1] == factor_bytes + bytes_per_sub_block * subs


def test_every_c_file_is_packaged() -> None:
    """A wheel without a header cannot compile the kernels (they would be off, silently slower)."""
    pyproject = tomllib.loads((CSRC.parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["tokenmill.models"]
    packaged = {p for pattern in patterns for p in CSRC.parent.glob(pattern)}
    assert set(CSRC.glob("*")) <= packaged

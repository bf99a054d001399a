"""The command line's pool options: the declared options as flags read back as PinnedPool keywords, and the
layout (``--layout FAMILY`` with a flag per field, or ``--layout-file``); torch comes only with the layout."""

from __future__ import annotations

import argparse
import json
import os
import stat
from dataclasses import MISSING, dataclass, fields
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError
from .._plan.declared import OPTIONS, PER_BUFFER, Flag, Option
from .._units import HUGETLB_PAGE_SIZES, format_bytes, parse_size, size_error
from ..runtimes import runtime_choices

if TYPE_CHECKING:
    from ..layouts import Layout
    from ..runtimes import Capabilities


def cli_size(option: str, text: str) -> int:
    """:func:`parse_size`, but a number without a unit counts bytes, so it must be whole (``1.5``: a typo)."""
    stripped = text.strip()
    if stripped.startswith("-"):
        raise size_error(option, text, "is not positive")
    number = stripped[:-1].rstrip() if stripped[-1:] in ("b", "B") else stripped
    try:
        value = Decimal(number)
    except InvalidOperation:
        return parse_size(text, what=option)  # has a unit (or is not a size): parse_size explains
    if value.is_finite() and value != value.to_integral_value():
        whole = "is not a whole number of bytes (without a unit, a size counts bytes)"
        raise size_error(option, text, whole, f"add a unit, e.g. {option} {number}GiB")
    return parse_size(text, what=option)


def int_text(where: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{where} {text!r} is not an integer") from None


def shape_text(where: str, text: str) -> tuple[int, ...]:  # 8,64,128
    return tuple(int_text(where, part.strip()) for part in text.split(",") if part.strip())


def codes_text(flag: str, text: str) -> tuple[int, ...]:
    """``--retry-codes``: ``1,2`` (checked by the pool), or ``none`` for no retry."""
    return () if text.strip().lower() == "none" else shape_text(flag, text)


def seconds_text(flag: str, text: str) -> float | str | None:
    """``--max-call-seconds``: a number (checked by the pool), ``auto`` or ``none``."""
    word = text.strip().lower()
    if word in ("auto", "none"):
        return "auto" if word == "auto" else None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag} {text}: give a number of seconds (e.g. 0.02), auto or none") from None


def nice_text(flag: str, text: str) -> int | str:
    """``--pin-nice``: an integer (checked by the pool) or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag} {text}: give an integer from 0 to 19, or auto") from None


def hold_seconds(text: str | None) -> float | None:
    """``--hold``: None for no hold, ``math.inf`` for forever, else seconds >= 0."""
    if text is None:
        return None
    if text.strip().lower() == "forever":
        return float("inf")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ConfigError(f"--hold {text}: give a number of seconds >= 0, or 'forever' (until Ctrl-C or SIGTERM)")
    return seconds


@dataclass(frozen=True)
class Field:
    """One layout constructor field: its command-line option and how its text is read."""

    flag: str
    kind: str  # int, bytes, dtype, shape, shapes, choice, text, flag
    help: str

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


# Every field of every class in FAMILIES, by its constructor name.
FIELDS: dict[str, Field] = {
    "layout": Field("--kv-layout", "choice", "layout kind: layer_first, page_first, page_first_direct, page_head, "
                    "page_unified or page_first_kv_split"),
    "layer_num": Field("--layer-num", "int", "layers"),
    "page_size": Field("--page-size", "int", "tokens per page"),
    "head_num": Field("--head-num", "int", "KV heads (mha)"),
    "head_dim": Field("--head-dim", "int", "head dimension (mha)"),
    "v_head_dim": Field("--v-head-dim", "int", "V head dimension when it differs from --head-dim (mha)"),
    "k_only": Field("--k-only", "flag", "K without V (mha)"),
    "head_group_num": Field("--head-group-num", "int", "kv-head groups a page_unified page is cut into (mha)"),
    "kv_cache_dim": Field("--kv-cache-dim", "int", "latent dimension per token and layer (mla)"),
    "qk_rope_head_dim": Field("--qk-rope-head-dim", "int", "V (rope) width; K gets the rest (mla page_first_kv_split)"),
    "index_layer_num": Field("--index-layer-num", "int", "indexer layers (mla page_first_kv_split)"),
    "index_scales": Field("--index-scales", "flag", "fp32 indexer scales (mla page_first_kv_split)"),
    "dtype": Field("--dtype", "dtype", "element type, e.g. bfloat16, float16, float8_e4m3fn"),
    "temporal_dtype": Field("--temporal-dtype", "dtype", "temporal state dtype, default --dtype (mamba)"),
    "conv_dtype": Field("--conv-dtype", "dtype", "conv state dtype, default --dtype (mamba)"),
    "num_mamba_layers": Field("--num-mamba-layers", "int", "Mamba layers (mamba)"),
    "temporal_shape": Field("--temporal-shape", "shape", "temporal state shape, e.g. 8,64,128 (mamba)"),
    "conv_shapes": Field("--conv-shapes", "shapes", "conv state shapes, e.g. '4,8192;4,512' (mamba)"),
    "index_head_dim": Field("--index-head-dim", "int", "indexer head dimension (indexer, mla page_first_kv_split)"),
    "quant_block_size": Field("--quant-block-size", "int", "elements per fp32 scale (indexer)"),
    "item_bytes": Field("--item-bytes", "bytes", "bytes per page and layer (paged)"),
    "granularity_bytes": Field("--granularity", "bytes", "copy-page size chunk boundaries align to (raw, dense)"),
    "shape": Field("--shape", "shape", "the tensor of a one-page pool, e.g. 2,64,32,8,128 (dense)"),
    "page_dim": Field("--page-dim", "int", "the dimension pages stack along, default 0 (dense)"),
    "buffer": Field("--buffer-name", "text", "the buffer's name, pool.tensors[NAME], default data (dense)"),
}  # fmt: skip

# --layout FAMILY -> the class in pinpool.layouts; its fields are the dataclass's own.
FAMILIES: dict[str, str] = {"raw": "Raw", "mha": "MHA", "mla": "MLA", "mamba": "Mamba", "indexer": "Indexer",
                             "paged": "PagedBytes", "dense": "Dense"}  # fmt: skip


def _dtype(where: str, value: object) -> Any:
    from ..layouts._spec import DTYPE_SPELLINGS, parse_dtype  # the layouts' own parser (loads torch)

    dtype = parse_dtype(value)
    if dtype is None:
        raise ConfigError(f"{where} {value!r} is not a torch dtype; give {DTYPE_SPELLINGS}")
    return dtype


def _field_value(field: Field, where: str, value: object, *, from_text: bool) -> object:
    """A field's value from command-line text or JSON; the layout class checks it."""
    if field.kind == "dtype":
        return _dtype(where, value)
    if field.kind == "bytes":
        return cli_size(field.flag if from_text else where, value) if isinstance(value, str) else value
    if from_text and isinstance(value, str):
        if field.kind == "int":
            return int_text(where, value)
        if field.kind == "shape":
            return shape_text(where, value)
        if field.kind == "shapes":
            return tuple(shape_text(where, shape) for shape in value.split(";") if shape.strip())
        return value
    if field.kind == "shape" and isinstance(value, list):
        return tuple(value)
    if field.kind == "shapes" and isinstance(value, list):
        return tuple(tuple(shape) if isinstance(shape, list) else shape for shape in value)
    return value


def family_class(family: str) -> type[Any]:  # imports pinpool.layouts, so torch
    from .. import layouts

    cls: type[Any] = getattr(layouts, FAMILIES[family])
    return cls


def family_fields(family: str) -> tuple[str, ...]:  # in declaration order
    return tuple(f.name for f in fields(family_class(family)))


def build_layout(family: str, given: dict[str, object], *, source: str, from_text: bool) -> Layout:
    """A layout of ``family`` from field values; ``source`` names where they came from (``--layout mha``, a file)."""
    if family not in FAMILIES:
        raise ConfigError(f"{source}: unknown layout family {family!r}; choose one of {', '.join(FAMILIES)}")
    cls = family_class(family)
    names = family_fields(family)
    label = (lambda n: FIELDS[n].flag) if from_text else (lambda n: n)
    extra = sorted(set(given) - set(names))
    if extra:
        raise ConfigError(
            f"{source} has no {', '.join(map(label, extra))}; its fields are {', '.join(map(label, names))}"
        )
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in given]
    if missing:
        raise ConfigError(f"{source} also needs {', '.join(map(label, missing))}")
    kwargs = {
        name: _field_value(FIELDS[name], label(name) if from_text else f"{source}: {name}", value, from_text=from_text)
        for name, value in given.items()
    }
    layout: Layout = cls(**kwargs)
    return layout


def layout_from_args(args: argparse.Namespace) -> Layout:
    """The layout the command line asks for: ``--layout-file`` or ``--layout`` with its dims."""
    given = {name: getattr(args, f.dest) for name, f in FIELDS.items() if getattr(args, f.dest) is not None}
    if args.layout_file is not None:
        if args.layout is not None or given:
            flags = [*(["--layout"] if args.layout is not None else []), *(FIELDS[n].flag for n in given)]
            raise ConfigError(f"--layout-file {args.layout_file} takes no {', '.join(flags)}: put them in the file")
        return layout_from_file(args.layout_file)
    family = args.layout or "raw"
    return build_layout(family, given, source=f"--layout {family}", from_text=True)


LAYOUT_FILE_MAX_BYTES = 1 << 20  # a layout is a few hundred bytes; more is the wrong file


def _read_layout_file(path: str) -> bytes:
    """The file's bytes; never a special file (a FIFO blocks for ever, /dev/zero reads until the OOM killer)."""
    try:
        # O_NONBLOCK: opening a FIFO would wait for a writer (a regular file's reads ignore the flag).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise ConfigError(
                    f"--layout-file {path} is {_file_kind(mode)}, not a regular file: give a regular JSON file"
                )
            with open(fd, "rb", closefd=False) as f:
                data = f.read(LAYOUT_FILE_MAX_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(f"--layout-file {path}: cannot read it ({exc.strerror})") from None
    if len(data) > LAYOUT_FILE_MAX_BYTES:
        raise ConfigError(
            f"--layout-file {path} is larger than {format_bytes(LAYOUT_FILE_MAX_BYTES)}, the limit for a layout "
            "file: give the JSON file that describes the layout"
        )
    return data


def _file_kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]  # fmt: skip
    return next((kind for test, kind in kinds if test(mode)), "a special file")


def layout_from_file(path: str) -> Layout:
    """A layout from a JSON object ``{"family": "mha", "layout": "page_first", "layer_num": 32, ...}``."""
    data = _read_layout_file(path)
    try:
        spec = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--layout-file {path}: not JSON ({exc})") from None
    except RecursionError:  # json's decoder recurses once per bracket
        raise ConfigError(
            f"--layout-file {path}: its JSON nests too deeply to read; a layout is one object of numbers, "
            "names and short lists: give the JSON file that describes the layout"
        ) from None
    if not isinstance(spec, dict) or not isinstance(spec.get("family"), str):
        raise ConfigError(
            f'--layout-file {path}: give a JSON object with a "family" ({", ".join(FAMILIES)}) and the '
            'layout\'s fields, e.g. {"family": "mha", "layout": "page_first", "layer_num": 32, "page_size": 64, '
            '"head_num": 8, "head_dim": 128, "dtype": "bfloat16"}'
        )
    family = spec.pop("family")
    return build_layout(family, spec, source=f"--layout-file {path} ({family})", from_text=False)


METAVARS = {"int": "N", "bytes": "SIZE", "dtype": "DTYPE", "shape": "SHAPE", "shapes": "SHAPES", "choice": "KIND",
            "text": "NAME"}  # fmt: skip


def add_layout_group(parser: argparse.ArgumentParser) -> None:
    """``--layout``, ``--layout-file`` and one flag per field of :data:`FIELDS`."""
    layout = parser.add_argument_group(
        "layout", "what the pool holds: --layout FAMILY with its dimensions, or --layout-file (default: raw bytes)"
    )
    layout.add_argument("--layout", choices=list(FAMILIES), help="layout family (default raw)")
    layout.add_argument("--layout-file", metavar="PATH", help='a regular file (at most 1 MiB) holding a JSON object: '
                        '{"family": "mha", "layout": "page_first", "layer_num": 32, ...}')  # fmt: skip
    for field in FIELDS.values():
        if field.kind == "flag":
            layout.add_argument(field.flag, action="store_true", default=None, help=field.help)
        else:
            layout.add_argument(field.flag, metavar=METAVARS[field.kind], help=field.help)


HUGE_PAGES: dict[str, bool | str] = {"off": False, "thp": True, **{name: name for name in HUGETLB_PAGE_SIZES}}
CLI_RUNTIMES = tuple(dict.fromkeys((*runtime_choices(), "fake")))


def flags(command: str) -> list[tuple[Option, Flag]]:  # in the declaration's order
    return [(o, o.flag) for o in OPTIONS if o.flag is not None and command in o.flag.commands]


def _flag_value(flag: Flag, value: Any) -> Any:
    if flag.kind == "size":
        return cli_size(flag.flag, value)
    if flag.kind == "chunk":
        return PER_BUFFER if value.strip() == PER_BUFFER else cli_size(flag.flag, value)
    if flag.kind == "seconds":
        return seconds_text(flag.flag, value)
    if flag.kind == "codes":
        return codes_text(flag.flag, value)
    if flag.kind == "nice":
        return nice_text(flag.flag, value)
    if flag.kind == "huge_pages":
        return HUGE_PAGES[value]
    return value  # int (argparse's type=int), text, runtime (a name), bool, switch


def text_options(args: argparse.Namespace, command: str = "pin") -> dict[str, Any]:
    """:func:`pool_options` but the layout, read without torch."""
    given: dict[str, Any] = {}
    for opt, flag in flags(command):
        if flag.kind == "layout":
            continue
        value = getattr(args, flag.dest)
        if value is None and command != "doctor" and flag.default is not None:
            if opt.name == "size" and getattr(args, "num_pages", None) is not None:
                continue  # --num-pages instead of a size
            value = flag.default
        if value is not None:
            given[opt.name] = _flag_value(flag, value)
    return given


def pool_options(args: argparse.Namespace, command: str = "pin") -> dict[str, Any]:
    """PinnedPool keywords from the flags and the command line's defaults; the layout last (it imports torch)."""
    given = text_options(args, command)
    if any(flag.kind == "layout" for _opt, flag in flags(command)):
        given["layout"] = layout_from_args(args)
    return given


def runtime_arg(name: str) -> Any:
    """What ``runtime=`` gets: a registered name, or a FakeRuntime for ``--runtime fake``."""
    if name == "fake":
        from ..testing import FakeRuntime

        return FakeRuntime()
    return name


def plan_runtime(name: str) -> tuple[str, Capabilities, bool]:
    """(name, declared capabilities, available here) without building the runtime or starting a driver."""
    from ..runtimes import auto_runtime_name, capabilities_of, runtime_info

    if name == "fake":
        from ..testing import FakeRuntime

        return name, FakeRuntime().capabilities, True
    resolved = auto_runtime_name() if name == "auto" else name
    info = runtime_info(resolved)
    # Registered factories are the runtime classes; their capabilities are class attributes.
    return resolved, capabilities_of(info.factory), info.available()  # type: ignore[arg-type]


def add_pool_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Every declared option ``command`` takes, as a flag of its kind, defaulting to None ("not given")."""
    pool = parser.add_argument_group("pool", "the options of PinnedPool(...) of the same names (docs/options.md)")
    layout_flag = False
    for opt, flag in flags(command):
        help_text = f"{opt.help} {flag.note}".strip().replace("%", "%%")  # argparse formats %
        if flag.kind == "layout":
            layout_flag = True  # its own group, after this one
        elif flag.kind == "bool":
            pool.add_argument(flag.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif flag.kind == "switch":
            pool.add_argument(flag.flag, action="store_true", default=None, help=help_text)
        elif flag.kind == "runtime":
            pool.add_argument(flag.flag, default="auto", choices=CLI_RUNTIMES, help=help_text)
        elif flag.kind == "huge_pages":
            pool.add_argument(flag.flag, nargs="?", const="thp", default=None, choices=list(HUGE_PAGES), help=help_text)
        else:
            pool.add_argument(flag.flag, type=int if flag.kind == "int" else str, metavar=flag.metavar, help=help_text)
    if layout_flag:
        add_layout_group(parser)

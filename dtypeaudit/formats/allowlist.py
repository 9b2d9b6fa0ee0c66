"""Which pickle globals and opcodes the loaders accept: the safety verdicts, kept apart from the interpreter.

Two loaders read a torch.save file. ``torch.load(weights_only=True)`` (the default since torch 2.6)
runs ``torch/_weights_only_unpickler.py``: a fixed opcode subset and an allowlist of globals. Anything
else makes it refuse, and the user's way out is ``weights_only=False``: CPython's full unpickler, which
imports whatever the file names. This module states what the first accepts (modelled on torch 2.13,
checked against torch's own tables in tests/test_allowlist.py) and how dangerous the rest is.
"""

from __future__ import annotations

from .. import dtypes
from .training import RNG_STATE_FILE

# -- torch.load(weights_only=True) -----------------------------------------------------------------

# The opcodes _weights_only_unpickler.Unpickler.load handles; any other is "Unsupported operand".
# Protocol 2 as torch.save writes it needs nothing more; FRAME (protocol 4+) is not among them.
WEIGHTS_ONLY_OPCODES = frozenset(
    {
        "APPEND", "APPENDS", "BINFLOAT", "BINGET", "BININT", "BININT1", "BININT2", "BINPERSID", "BINPUT",
        "BINUNICODE", "BUILD", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET", "EMPTY_TUPLE", "GLOBAL", "LONG1",
        "LONG_BINGET", "LONG_BINPUT", "MARK", "NEWFALSE", "NEWOBJ", "NEWTRUE", "NONE", "PROTO", "REDUCE",
        "SETITEM", "SETITEMS", "SHORT_BINSTRING", "STOP", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    }
)  # fmt: skip

_TENSOR_TYPE_NAMES = ("Double", "Float", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool")
_SPARSE_TYPE_NAMES = ("Double", "Float", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte")
_REBUILDS = (
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter", "_rebuild_parameter_with_state",
    "_rebuild_qtensor", "_rebuild_sparse_tensor", "_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor",
    "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor",
)  # fmt: skip
_QSCHEMES = ("per_tensor_affine", "per_tensor_symmetric", "per_channel_affine", "per_channel_symmetric", "per_channel_affine_float_qparams")

# _get_allowed_globals() of torch 2.13, by the name a GLOBAL opcode spells.
WEIGHTS_ONLY_GLOBALS = frozenset(
    {
        "collections.OrderedDict",
        "collections.Counter",
        "torch.nn.parameter.Parameter",
        "torch.serialization._get_layout",
        "torch.Size",
        "torch.Tensor",
        "torch.device",
        "_codecs.encode",
        "builtins.bytearray",
        "builtins.set",
        "builtins.complex",
        "torch.storage.TypedStorage",
        "torch.storage.UntypedStorage",
        "torch._tensor._rebuild_from_type_v2",
        *(f"torch.{name}" for name in dtypes.DTYPES),
        *(f"torch.{q}" for q in _QSCHEMES),
        *(f"torch._utils.{f}" for f in _REBUILDS),
        *(f"torch.{n}Tensor" for n in _TENSOR_TYPE_NAMES),
        *(f"torch.cuda.{n}Tensor" for n in _TENSOR_TYPE_NAMES),
        *(f"torch.sparse.{n}Tensor" for n in _SPARSE_TYPE_NAMES),
        *(f"torch.cuda.sparse.{n}Tensor" for n in _SPARSE_TYPE_NAMES),
        *(f"torch.{name}" for name in dtypes.STORAGE_CLASSES),
        *(f"torch.cuda.{name}" for name in dtypes.STORAGE_CLASSES if not name.startswith(("QInt", "QUInt"))),
    }
)

# Modules weights_only refuses even when a user allowlists something in them.
WEIGHTS_ONLY_BLOCKED_MODULES = frozenset({"sys", "os", "posix", "nt"})

# torch._utils' IMPORT_MAPPING / NAME_MAPPING: weights_only applies these Python 2 renames to every
# GLOBAL, whatever the protocol (CPython's unpickler applies its larger table only below protocol 3).
WEIGHTS_ONLY_MODULE_RENAMES = {
    "__builtin__": "builtins", "copy_reg": "copyreg", "Queue": "queue", "repr": "reprlib", "_abcoll": "collections.abc",
    "UserDict": "collections", "UserList": "collections", "UserString": "collections", "whichdb": "dbm",
    "StringIO": "io", "cStringIO": "io",
}  # fmt: skip
WEIGHTS_ONLY_NAME_RENAMES = {
    ("__builtin__", "xrange"): ("builtins", "range"),
    ("__builtin__", "reduce"): ("functools", "reduce"),
    ("__builtin__", "intern"): ("sys", "intern"),
    ("__builtin__", "unichr"): ("builtins", "chr"),
    ("__builtin__", "unicode"): ("builtins", "str"),
    ("__builtin__", "long"): ("builtins", "int"),
    ("itertools", "izip"): ("builtins", "zip"),
    ("itertools", "imap"): ("builtins", "map"),
    ("itertools", "ifilter"): ("builtins", "filter"),
    ("itertools", "ifilterfalse"): ("itertools", "filterfalse"),
    ("itertools", "izip_longest"): ("itertools", "zip_longest"),
    ("UserDict", "IterableUserDict"): ("collections", "UserDict"),
    ("UserList", "UserList"): ("collections", "UserList"),
    ("UserString", "UserString"): ("collections", "UserString"),
    ("__builtin__", "basestring"): ("builtins", "str"),
    ("exceptions", "StandardError"): ("builtins", "Exception"),
    ("UserDict", "UserDict"): ("collections", "UserDict"),
}


def weights_only_name(module: str, name: str) -> str:
    """The qualified name weights_only looks up for ``GLOBAL module name``."""
    if (module, name) in WEIGHTS_ONLY_NAME_RENAMES:
        module, name = WEIGHTS_ONLY_NAME_RENAMES[(module, name)]
    else:
        module = WEIGHTS_ONLY_MODULE_RENAMES.get(module, module)
    return f"{module}.{name}"


def weights_only_accepts_global(qualname: str) -> bool:
    module = qualname.rsplit(".", 1)[0]
    return module not in WEIGHTS_ONLY_BLOCKED_MODULES and qualname in WEIGHTS_ONLY_GLOBALS


# -- what a file's own loader adds ----------------------------------------------------------------

# transformers' Trainer._load_rng_state (5.24) reads rng_state.pth with torch.load(weights_only=True) inside
# trainer_pt_utils.safe_globals(), which allow-lists numpy's array globals (np.random.get_state()'s key array):
# the one loader of that file accepts them. _reconstruct in both numpy spellings: the Trainer allow-lists the
# installed numpy's, and the file names that of the numpy that wrote it, the same one when a run resumes.
TRAINER_RNG_STATE_GLOBALS = frozenset(
    {
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        "numpy.dtypes.UInt32DType",
    }
)


def accepted_by_its_loader(file_name: str, qualname: str) -> bool:
    """Whether the loader that reads a file of this name (its path; the last part counts) accepts ``qualname``
    beyond weights_only's own allowlist: the Trainer's ``rng_state.pth`` and its numpy globals."""
    name = file_name.replace("\\", "/").rsplit("/", 1)[-1]
    return RNG_STATE_FILE.match(name) is not None and qualname in TRAINER_RNG_STATE_GLOBALS


# Attributes that, set on a tensor by a rebuild's ``state`` (torch._utils._set_obj_state does a plain
# setattr), change what the tensor is: its data, dtype, class or gradient. The list is every data
# descriptor on torch.nn.Parameter's classes in torch 2.13; tests/test_allowlist.py keeps it complete.
TENSOR_DESCRIPTORS = frozenset(
    {
        "H", "T", "__class__", "__cuda_array_interface__", "__dict__", "__weakref__", "_backward_hooks", "_base", "_cdata",
        "_grad", "_grad_fn", "_has_symbolic_sizes_strides", "_post_accumulate_grad_hooks", "_python_dispatch", "_version",
        "data", "device", "dtype", "grad", "grad_dtype", "grad_fn", "imag", "is_cpu", "is_cuda", "is_ipu", "is_leaf",
        "is_maia", "is_meta", "is_mkldnn", "is_mps", "is_mtia", "is_nested", "is_quantized", "is_sparse", "is_sparse_csr",
        "is_vulkan", "is_xla", "is_xpu", "itemsize", "layout", "mH", "mT", "name", "names", "nbytes", "ndim", "output_nr",
        "real", "requires_grad", "retains_grad", "shape", "volatile",
    }
)  # fmt: skip

# Keys torch._C._set_tensor_metadata understands (torch.save writes them for conjugate and negative views).
TENSOR_METADATA_KEYS = frozenset({"conj", "neg"})

# -- how bad the rest is -------------------------------------------------------------------------

# TorchScript archives are read by torch.jit.load's C++ unpickler, which also resolves these.
TORCHSCRIPT_PREFIXES = ("__torch__.", "torch.jit._pickle.")

# Globals that can run code or touch the system when a trusting loader resolves them.
_DANGEROUS_MODULES = (
    "os", "posix", "nt", "subprocess", "sys", "runpy", "importlib", "pickle", "_pickle", "shutil",
    "socket", "webbrowser", "pty", "code", "codeop", "ctypes", "marshal", "multiprocessing", "asyncio",
    "http", "urllib", "requests", "types", "io", "pathlib._local", "tempfile", "signal", "threading",
    "torch.hub", "torch.jit", "dill", "cloudpickle", "numpy.testing", "pip", "setuptools", "commands",
    "popen2", "platform", "pydoc", "timeit", "bdb", "pdb", "trace", "profile", "cProfile", "doctest",
    "torch._dynamo", "torch._inductor", "torch.utils.cpp_extension", "torch.package",
)  # fmt: skip
_DANGEROUS_EXACT = frozenset(
    {
        *(
            f"builtins.{n}"
            for n in (
                "eval",
                "exec",
                "compile",
                "getattr",
                "setattr",
                "delattr",
                "__import__",
                "open",
                "globals",
                "locals",
                "vars",
                "breakpoint",
                "input",
                "apply",
                "execfile",
                "print",
                "help",
                "memoryview",
                "type",
                "super",
                "classmethod",
                "staticmethod",
                "property",
            )
        ),  # fmt: skip
        "functools.partial",
        "functools.reduce",
        "operator.attrgetter",
        "operator.methodcaller",
        "operator.itemgetter",
        "torch.load",
        "torch.save",
        "torch.serialization.load",
        "torch._C._load_for_lite_interpreter",
        "numpy.load",
        "numpy.lib.npyio.load",
    }
)

# Plain data classes common in training checkpoints: harmless in practice, yet torch's
# weights_only loader refuses them, so loading the file still means trusting it.
_DATA_CLASSES = frozenset(
    {
        "argparse.Namespace",
        "pytorch_lightning.utilities.parsing.AttributeDict",
        "lightning.fabric.utilities.data.AttributeDict",
        "lightning_fabric.utilities.data.AttributeDict",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "pathlib.PurePosixPath",
        "datetime.datetime",
        "datetime.date",
        "datetime.timedelta",
        "builtins.dict",
        "builtins.list",
        "builtins.tuple",
        "builtins.int",
        "builtins.float",
        "builtins.str",
        "builtins.bool",
        "builtins.frozenset",
        "builtins.slice",
        "builtins.bytes",
        "builtins.object",
        "builtins.range",
        "copyreg._reconstructor",
        "enum.Enum",
        "torch.strided",
        "torch.sparse_coo",
        "torch.sparse_csr",
        "torch.sparse_csc",
        "torch.sparse_bsr",
        "torch.sparse_bsc",
        "torch.contiguous_format",
        "torch.channels_last",
        "torch.channels_last_3d",
        "torch.preserve_format",
    }
)


def classify_global(qualname: str, *, torchscript: bool = False) -> str:
    """``safe`` (weights_only loads it), ``data`` (a plain data class it refuses), ``dangerous`` or ``unknown``."""
    if weights_only_accepts_global(qualname) or (torchscript and qualname.startswith(TORCHSCRIPT_PREFIXES)):
        return "safe"
    if (
        qualname in _DANGEROUS_EXACT
        or qualname.split(".")[0] in _DANGEROUS_MODULES
        or any(qualname.startswith(m + ".") for m in _DANGEROUS_MODULES)
    ):
        return "dangerous"
    if qualname in _DATA_CLASSES or qualname.startswith(("numpy.dtypes.", "omegaconf.")):
        return "data"
    return "unknown"

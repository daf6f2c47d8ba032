"""CUDA emulated on a CPU build of torch, so that device-placement bugs show in CI without a GPU.

`emulated_cuda()` makes tensors that report `cuda:0` but hold CPU values (`Emulated`), and a TorchDispatchMode
(`CudaRules`) that applies CUDA's device rules to every aten op while it runs the op on those values:
- an op whose tensors are on cuda and on cpu raises as CUDA does ("Expected all tensors to be on the same
  device"), except where PyTorch allows it: 0-dim CPU tensors (scalars) beside CUDA tensors, CPU index
  tensors into a CUDA tensor (`index`, `index_put_`: ATen moves them), and copies between devices;
- `.numpy()` of a cuda tensor raises, `.tolist()` and `.item()` are host syncs and are counted (`syncs`);
- a sampling op on cuda tensors with a CPU generator raises as CUDA does; `torch.Generator(device="cuda")`
  gives a generator the rules take for a CUDA one (its draws are a CPU generator's, so tokens equal CPU's);
- collectives: `init_process_group("nccl")` makes a gloo group that `get_backend` calls "nccl", and a
  collective on it refuses CPU tensors as NCCL does; gloo groups made as such stay gloo (CPU tensors).
`torch.cuda`'s queries are patched (one device, capability 8.0, memory figures from MEMORY), and the CPU
build's missing CUDA device guard is a ~30-line C++ no-op, built once with torch.utils.cpp_extension.

What it cannot see: real kernels (values are CPU's, the int4/int8 CUDA kernels run as CPU stand-ins or
not at all), streams, asynchrony (every op here is synchronous), memory, CUDA graphs, NCCL itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from types import SimpleNamespace
from unittest import mock

import torch
import torch.cuda.nccl
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

MEMORY = SimpleNamespace(total=80 * 2**30, free=60 * 2**30, peak=2 * 2**30)
CUDA = torch.device("cuda", 0)

GUARD = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>

// CUDA's device guard for a CPU build of torch: one device, no streams, nothing to switch.
struct EmulatedCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device) const override { return c10::Device(c10::DeviceType::CUDA, 0); }
  c10::Device getDevice() const override { return c10::Device(c10::DeviceType::CUDA, 0); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CUDA, 0));
  }
  c10::Stream exchangeStream(c10::Stream) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CUDA, 0));
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};

C10_REGISTER_GUARD_IMPL(CUDA, EmulatedCudaGuard);
"""


def unavailable() -> str | None:
    """Why the emulation cannot run here (pytest's skip reason), or None: it needs a CPU build of torch, a C++
    compiler for the guard, and the private torch APIs it is built on."""
    if torch.cuda.is_available() or torch.version.cuda is not None:
        return "a CUDA build of torch: the emulation is for CPU builds (run the CUDA tests instead)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler to build the emulated CUDA device guard"
    for owner, name in ((torch.Tensor, "_make_wrapper_subclass"), (torch.cuda, "_lazy_init"),
                        (dist.ProcessGroup, "unbox"), (c10d, "_get_object_coll_device"),
                        (torch.ops, "_c10d_functional"), (torch._C, "_disabled_torch_function_impl")):
        if not hasattr(owner, name):
            owner = getattr(owner, "__name__", owner)
            return f"torch {torch.__version__} has no {owner}.{name}, which the emulation uses"
    return None


_GUARD_BUILT = False


def build_guard() -> None:
    """Compile the guard (c10 headers only: a few seconds, cached on disk by torch) and load it, once per process:
    a plain shared library whose static initializer registers it."""
    global _GUARD_BUILT
    if _GUARD_BUILT:
        return
    from torch.utils.cpp_extension import load

    where = os.path.join(os.path.expanduser("~/.cache/autotp-tests"), f"cuda-guard-torch-{torch.__version__}")
    os.makedirs(where, exist_ok=True)
    source = os.path.join(where, "guard.cpp")
    if not os.path.exists(source) or open(source).read() != GUARD:
        with open(source, "w") as f:
            f.write(GUARD)
    load("autotp_emulated_cuda_guard", [source], is_python_module=False, extra_cflags=["-O0"], build_directory=where)
    _GUARD_BUILT = True


class Emulated(torch.Tensor):
    """A tensor that says `cuda:0` and holds a CPU tensor (`inner`) with the same shape, strides and values."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=CUDA, requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"an emulated CUDA tensor reached {func} outside emulated_cuda()")

    def __repr__(self) -> str:
        return f"Emulated({self.inner!r})"

    def tolist(self):
        _RULES[-1].sync("tolist")
        return self.inner.tolist()

    def numpy(self, *, force: bool = False):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")

    def data_ptr(self) -> int:
        return self.inner.data_ptr()

    # Python indexing turns a list of ints into a tensor on the indexed tensor's device with the modes off: here
    # it becomes a CPU index tensor first, which CUDA takes (a host-to-device copy, as the list is on CUDA)
    def __getitem__(self, index):
        return super().__getitem__(_lists_to_tensors(index))

    def __setitem__(self, index, value):
        return super().__setitem__(_lists_to_tensors(index), value)


def _lists_to_tensors(index):
    if isinstance(index, list):
        return torch.tensor(index) if index else torch.empty(0, dtype=torch.long)
    if isinstance(index, tuple):
        return tuple(_lists_to_tensors(i) for i in index)
    return index


class DeviceMismatch(RuntimeError):
    """What CUDA raises where tensors on two devices meet in one op."""


# ops that take tensors on either side of a copy
CROSS_DEVICE = {"aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::copy"}
# ops where CUDA takes CPU index tensors (ATen's AdvancedIndex moves them to the device)
CPU_INDICES = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_", "aten::_unsafe_index"}
SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique2",
         "aten::item"}


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class CudaRules(TorchDispatchMode):
    """Runs every op on the CPU values of emulated tensors, refusing what CUDA refuses (see the module)."""

    def __init__(self, nccl_groups: set[str]):
        super().__init__()
        self.nccl_groups = nccl_groups
        self.syncs: dict[str, int] = {}
        self.uploads = 0  # blocking copies from the host: a pageable tensor, or a Python value, written to the device
        self.ops = 0

    def sync(self, what: str) -> None:
        self.syncs[what] = self.syncs.get(what, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = func._schema.name
        self.ops += 1
        flat, _ = tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        on_cuda = any(isinstance(x, Emulated) for x in tensors)
        to_cuda = _is_cuda(kwargs.get("device"))
        if "device" in kwargs and to_cuda:
            kwargs["device"] = torch.device("cpu")
        if name.startswith(("c10d::", "_c10d_functional::")):
            return self._collective(func, name, args, kwargs, flat)
        if name not in CROSS_DEVICE:
            exempt = {id(x) for x in tree_flatten(args[1])[0]} if name in CPU_INDICES and len(args) > 1 else set()
            cpu = [x for x in tensors if not isinstance(x, Emulated) and x.device.type == "cpu" and x.dim() > 0
                   and id(x) not in exempt]
            if cpu and (on_cuda or to_cuda):
                raise DeviceMismatch(f"Expected all tensors to be on the same device, but found at least two "
                                     f"devices, cuda:0 and cpu! ({name}: a CPU tensor of shape "
                                     f"{tuple(cpu[0].shape)})")
        generator = kwargs.get("generator")
        if generator is not None and (on_cuda or to_cuda) != _cuda_generator(generator):
            want, got = ("cuda", "cpu") if on_cuda or to_cuda else ("cpu", "cuda")
            raise RuntimeError(f"Expected a '{want}' device type for generator but found '{got}'")
        if name in CROSS_DEVICE and (to_cuda or isinstance(args[0], Emulated)):
            source = args[0] if name == "aten::_to_copy" else args[1] if len(args) > 1 else None
            blocking = not (kwargs.get("non_blocking") or (name == "aten::copy_" and len(args) > 2 and args[2]))
            if blocking and isinstance(source, torch.Tensor) and not isinstance(source, Emulated):
                self.uploads += 1
        if on_cuda and (name in SYNCS or name in CROSS_DEVICE and not (to_cuda or isinstance(args[0], Emulated))):
            self.sync(name)  # a value the host waits for: a scalar, a data-dependent shape, a copy to the host
        wrappers = {id(x.inner): x for x in tensors if isinstance(x, Emulated)}
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if name == "aten::_to_copy":
            cuda_out = to_cuda or (on_cuda and "device" not in kwargs)
        elif name in CROSS_DEVICE:  # copy_(dst, src): dst's device
            cuda_out = isinstance(args[0], Emulated)
        else:
            cuda_out = on_cuda or to_cuda
        if not cuda_out:
            return out
        return tree_map(lambda o: _rewrap(o, wrappers, True), out)

    def _collective(self, func, name, args, kwargs, flat):
        groups = [x for x in flat if isinstance(x, str) and x in self.nccl_groups]  # functional collectives
        groups += [x for x in map(_process_group, flat) if x is not None and x.group_name in self.nccl_groups]
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        if groups and any(not isinstance(x, Emulated) for x in tensors):
            raise RuntimeError(f"No backend type associated with device type cpu ({name} on an NCCL group)")
        wrappers = {id(x.inner): x for x in tensors if isinstance(x, Emulated)}
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        return tree_map(lambda o: _rewrap(o, wrappers, bool(groups)), out)


def _process_group(x) -> dist.ProcessGroup | None:
    """A c10d op's process group reaches the dispatcher as a TorchScript object."""
    if isinstance(x, dist.ProcessGroup):
        return x
    if isinstance(x, torch.ScriptObject) and x._type().qualified_name().endswith("c10d.ProcessGroup"):
        return dist.ProcessGroup.unbox(x)
    return None


def _rewrap(o, wrappers: dict, cuda: bool):
    """An op's output: the input it returns (in-place ops return self), else a new emulated tensor if `cuda`."""
    if not isinstance(o, torch.Tensor):
        return o
    same = wrappers.get(id(o))
    if same is not None:
        return same
    return Emulated(o) if cuda else o


def _unwrap(x):
    return x.inner if isinstance(x, Emulated) else x


_RULES: list[CudaRules] = []


_CUDA_GENERATORS: list[torch.Generator] = []


class Generator(torch._C.Generator):
    """torch.Generator under the emulation: device="cuda" gives a CPU generator that the rules take for CUDA's."""

    def __new__(cls, device="cpu"):
        generator = super().__new__(cls, "cpu")
        if _is_cuda(device):
            _CUDA_GENERATORS.append(generator)
        return generator


def _cuda_generator(generator: torch.Generator) -> bool:
    """Whether an op's generator is one made for CUDA. An op receives a new Python object for the generator
    it was given, so it is recognised by its seed and state (a CPU generator in exactly the state of a CUDA
    one would pass for it)."""
    seed = generator.initial_seed()
    return any(g.initial_seed() == seed and torch.equal(g.get_state(), generator.get_state())
               for g in _CUDA_GENERATORS)


class NoGrad(torch.no_grad):
    """torch.inference_mode under the emulation: autograd's view tracking cannot give a wrapper subclass's views
    an inference tensor's version counter ("Cannot set version_counter for inference tensor"), so no_grad
    stands in; devices do not depend on which of the two runs."""

    def __init__(self, mode: bool = True):
        super().__init__()

    def __new__(cls, mode_or_fn=True):
        if callable(mode_or_fn):  # @torch.inference_mode without parentheses
            return torch.no_grad()(mode_or_fn)
        return super().__new__(cls)


def _on_device(make):
    """torch.tensor and its kin build a CUDA tensor with the dispatch modes off (C++'s internal_new_from_data):
    built on the CPU, then moved, which the rules see."""
    def build(data, *args, device=None, **kwargs):
        tensor = make(data, *args, **kwargs)
        return tensor.to(device) if _is_cuda(device) else tensor if device is None else tensor.to(device)
    return build


@contextlib.contextmanager
def emulated_cuda(capability: tuple[int, int] = (8, 0), name: str = "emulated CUDA device"):
    """Inside: torch in this thread behaves as a CUDA build with one GPU of this compute capability (see the
    module). Yields the rules, whose `syncs` count host syncs on cuda tensors by kind."""
    build_guard()
    nccl_groups: set[str] = set()
    rules = CudaRules(nccl_groups)
    init_process_group, new_group, get_backend = dist.init_process_group, dist.new_group, dist.get_backend
    rng = {"state": torch.get_rng_state()}

    def init(backend=None, *args, device_id=None, **kwargs):
        init_process_group("gloo" if backend in (None, "nccl") else backend, *args, **kwargs)
        if backend in (None, "nccl"):
            nccl_groups.add(dist.group.WORLD.group_name)

    def new(*args, backend=None, **kwargs):
        group = new_group(*args, backend=backend or "gloo", **kwargs)
        if backend is None and dist.group.WORLD.group_name in nccl_groups:
            nccl_groups.add(group.group_name)
        return group

    def backend_of(group=None):
        group = group or dist.group.WORLD
        return "nccl" if group is not None and group.group_name in nccl_groups else get_backend(group)

    object_device = c10d._get_object_coll_device

    def object_collectives_device(group=None):  # NCCL's object collectives pickle into CUDA tensors
        return "cuda" if backend_of(group) == "nccl" else object_device(group)

    # each rank its own GPU: a launcher that sets CUDA_VISIBLE_DEVICES per rank (every rank's is cuda:0)
    props = SimpleNamespace(name=name, uuid=f"GPU-emulated-rank-{os.environ.get('RANK', '0')}",
                            total_memory=MEMORY.total, major=capability[0], minor=capability[1],
                            multi_processor_count=108)
    patches = {
        (torch.cuda, "_lazy_init"): lambda: None,
        (torch.cuda, "is_available"): lambda: True,
        (torch.cuda, "device_count"): lambda: 1,
        (torch.cuda, "current_device"): lambda: 0,
        (torch.cuda, "set_device"): lambda device: None,
        (torch.cuda, "synchronize"): lambda device=None: rules.sync("synchronize"),
        (torch.cuda, "mem_get_info"): lambda device=None: (MEMORY.free, MEMORY.total),
        (torch.cuda, "get_device_capability"): lambda device=None: (props.major, props.minor),
        (torch.cuda, "get_device_properties"): lambda device=None: props,
        (torch.cuda, "get_device_name"): lambda device=None: props.name,
        (torch.cuda, "max_memory_allocated"): lambda device=None: MEMORY.peak,
        (torch.cuda, "memory_allocated"): lambda device=None: MEMORY.peak // 2,
        (torch.cuda, "reset_peak_memory_stats"): lambda device=None: None,
        (torch.cuda, "empty_cache"): lambda: None,
        (torch.cuda.nccl, "version"): lambda: (2, 0, 0),  # c10d's logger asks when a collective raises
        (torch.cuda, "get_rng_state"): lambda device="cuda": rng["state"].clone(),
        (torch.cuda, "set_rng_state"): lambda state, device="cuda": rng.update(state=state.clone()),
        (torch, "Generator"): Generator,
        (torch, "inference_mode"): NoGrad,
        (torch.Tensor, "pin_memory"): lambda self, device=None: self,  # page-locked host memory: a CUDA build's
        (torch.Tensor, "is_pinned"): lambda self, device=None: True,
        (torch, "tensor"): _on_device(torch.tensor),
        (torch, "as_tensor"): _on_device(torch.as_tensor),
        (torch, "asarray"): _on_device(torch.asarray),
        (dist, "init_process_group"): init,
        (dist, "new_group"): new,
        (dist, "get_backend"): backend_of,
        (c10d, "_get_object_coll_device"): object_collectives_device,
    }
    with contextlib.ExitStack() as stack:
        for (owner, name), value in patches.items():
            stack.enter_context(mock.patch.object(owner, name, value))
        if dist.is_initialized() and dist.get_backend() == "gloo":  # a pool's group stands in for NCCL's
            nccl_groups.add(dist.group.WORLD.group_name)
        _RULES.append(rules)
        _forget_devices()
        try:
            with rules:
                yield rules
        finally:
            _RULES.pop()
            _CUDA_GENERATORS.clear()
            _forget_devices()


def _forget_devices() -> None:
    """transformers caches what it found (is_torch_cuda_available and its kin): found again inside and after. So
    does `with torch.device(...)`: its set of factory functions, first made when some earlier test (a compile)
    entered one, holds the unpatched torch.tensor; made again, it holds the one that builds on the emulated GPU."""
    from torch.utils._device import _device_constructors
    from transformers.utils import import_utils

    _device_constructors.cache_clear()

    for value in vars(import_utils).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def to_cuda(tree):
    """CPU tensors in a (nested) structure -> emulated CUDA tensors (call inside emulated_cuda())."""
    return tree_map(lambda x: x.to("cuda") if isinstance(x, torch.Tensor) else x, tree)

"""What each Triton LoRA launch would compile, by Triton's own rules, recorded without compiling.

`KernelSpy` stands in for the four JIT kernels of triton_decode and triton_prefill: each launch
records its kernel, its constexprs and Triton's specialization of every other argument (the C
function Triton's launcher itself calls, honouring the kernel's do_not_specialize lists), and
runs the real kernel only when asked. Two launches that record the same entry run one binary;
an entry the warm-up never recorded is a compile on the request path.
"""

from __future__ import annotations

import contextlib

import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from toppings.gpu_lora.kernels import triton_decode, triton_prefill

KERNELS = ("_shrink_kernel", "_expand_kernel")


def _unspecialized(kernel) -> tuple[set[str], set[str]]:
    """(ints Triton does not specialize, pointers it does not specialize on alignment)."""
    if hasattr(kernel, "params"):  # compiled mode: triton.runtime.jit.JITFunction
        dns = {p.name for p in kernel.params if p.do_not_specialize}
        dns_align = {p.name for p in kernel.params if p.do_not_specialize_on_alignment}
        return dns, dns_align
    options = kernel.kwargs  # interpret mode: InterpretedFunction keeps triton.jit's options
    return set(options["do_not_specialize"] or ()), set(
        options["do_not_specialize_on_alignment"] or ()
    )


class _Spied:
    def __init__(self, label: str, kernel, spy: KernelSpy):
        self.label, self.kernel, self.spy = label, kernel, spy
        self.dns, self.dns_align = _unspecialized(kernel)

    def compiled_as(self, args, kwargs) -> tuple:
        names = self.kernel.arg_names
        values = dict(zip(names, args, strict=False)) | kwargs
        spec = []
        for name in names:
            value = values[name]
            if name in kwargs and not isinstance(value, torch.Tensor):  # a constexpr
                spec.append((name, "constexpr", value))
                continue
            specialize, align = name not in self.dns, name not in self.dns_align
            spec.append(
                (name, *native_specialize_impl(BaseBackend, value, False, specialize, align))
            )
        return self.label, tuple(spec)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.spy.seen.add(self.compiled_as(args, kwargs))
            if self.spy.run:
                self.kernel[grid](*args, **kwargs)

        return launch


class KernelSpy:
    """`seen`: every (kernel, specialization) launched while installed; run: launch for real."""

    def __init__(self, run: bool = False):
        self.run = run
        self.seen: set[tuple] = set()

    @contextlib.contextmanager
    def installed(self, monkeypatch):
        """Replace the four JIT kernels for the block (monkeypatch restores them)."""
        for module in (triton_decode, triton_prefill):
            for name in KERNELS:
                label = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
                monkeypatch.setattr(module, name, _Spied(label, getattr(module, name), self))
        try:
            yield self
        finally:
            for module in (triton_decode, triton_prefill):
                for name in KERNELS:
                    monkeypatch.setattr(module, name, getattr(module, name).kernel)

"""Run this process on a narrower CPU kernel path than the machine's own (the test suite's
portable mode, `make test-portable`). Loaded by every Python process started with this
directory on PYTHONPATH, vLLM's engine processes included; does nothing unless
PIPELINE_TEST_CPU_ISA is set.

Why a hook: torch (ATEN_CPU_CAPABILITY) and oneDNN (ONEDNN_MAX_CPU_ISA) take a cap from the
environment, but vLLM's CPU backend picks its kernels from torch.cpu's cpuinfo flags
(`torch.cpu._is_amx_tile_supported()`, `_is_avx512_bf16_supported()`, ...: which `_C` build it
loads, the AMX or vector attention, the AMX linear), which no variable caps. Capping oneDNN
alone on an AMX machine makes vLLM ask it for AMX kernels it then refuses ("BFloat16 Brgemm
VNNI format is only supported ... when amx is supported"). So this hides the flags above the
cap from torch.cpu.get_capabilities, which every one of those checks reads.

PIPELINE_TEST_CPU_ISA=avx2: no AVX-512, no AVX512-BF16, no AMX (vLLM loads _C_AVX2; torch's
kernels are capped by ATEN_CPU_CAPABILITY=avx2 and oneDNN's by ONEDNN_MAX_CPU_ISA=AVX2, which
the Makefile sets with it)."""
import os

_ISA = os.environ.get("PIPELINE_TEST_CPU_ISA", "")
# Flags above each cap (torch.cpu.get_capabilities() keys).
_HIDDEN = {"avx2": ("avx512", "amx")}

if _ISA:
    if _ISA not in _HIDDEN:
        raise SystemExit(f"PIPELINE_TEST_CPU_ISA={_ISA!r}: known kernel paths are {sorted(_HIDDEN)}")
    import importlib.abc
    import sys

    def _cap(module) -> None:
        original = module.get_capabilities

        def get_capabilities():
            return {k: (v and not k.startswith(_HIDDEN[_ISA])) for k, v in original().items()}

        module.get_capabilities = get_capabilities

    class _PatchTorchCpu(importlib.abc.MetaPathFinder):
        """Caps torch.cpu as soon as it is imported, without importing torch in processes that
        never do (Snakemake, small scripts)."""

        def find_spec(self, name, path, target=None):
            if name != "torch.cpu":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            sys.meta_path.insert(0, self)
            loader = spec.loader
            exec_module = loader.exec_module

            def patched(module):
                exec_module(module)
                _cap(module)

            loader.exec_module = patched
            return spec

    import importlib.util

    sys.meta_path.insert(0, _PatchTorchCpu())

"""Emulate `mx.fast.metal_kernel` on the CPU: same kernel text, compiled by g++.

`Emulator.launch` has the signature of `mlx_redrafter.kernels.fused.metal_launch`,
so the project's kernel wrappers run unchanged with it. For a spec it generates

    #include "driver.h"          (host I/O, grid loop; standard headers only)
    #include "metal_compat.h"    (address spaces, vector types, metal:: math)
    <spec.header, verbatim>
    void <name>(<the signature mx.fast.metal_kernel generates>) { <spec.source, verbatim> }
    <glue: one call per grid thread>

and builds it once per (spec text, dtypes) with AddressSanitizer and UBSan when
the toolchain has them, cached under a temporary directory.

The signature follows MLX's generator: each input as `const device T* name`
(`constant` for arrays under 8 elements; both are empty here), followed by
`const constant int* name_shape`, `const constant int64_t* name_strides` and
`const constant int& name_ndim` when those names occur in the source, then each
output as `device T* name`, then the thread attributes named in the source.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_redrafter.kernels.sources import KernelSpec

HERE = Path(__file__).parent

C_TYPES = {
    mx.float32: ("float", np.float32),
    mx.int32: ("int32_t", np.int32),
    mx.bool_: ("bool", np.bool_),
}

# Thread attributes MLX adds to the signature when named in the source, in MLX's
# order. Only grid-level ones can be emulated without threadgroups.
EMULATED_ATTRIBUTES = {
    "thread_position_in_grid": "uint3",
    "threads_per_grid": "uint3",
}
THREADGROUP_ATTRIBUTES = (
    "dispatch_quadgroups_per_threadgroup",
    "dispatch_simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup",
    "grid_origin",
    "grid_size",
    "quadgroup_index_in_threadgroup",
    "quadgroups_per_threadgroup",
    "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup",
    "thread_execution_width",
    "thread_index_in_quadgroup",
    "thread_index_in_simdgroup",
    "thread_index_in_threadgroup",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threadgroups_per_grid",
    "threads_per_simdgroup",
    "threads_per_threadgroup",
)
ALL_ATTRIBUTES = (
    "dispatch_quadgroups_per_threadgroup",
    "dispatch_simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup",
    "grid_origin",
    "grid_size",
    "quadgroup_index_in_threadgroup",
    "quadgroups_per_threadgroup",
    "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup",
    "thread_execution_width",
    "thread_index_in_quadgroup",
    "thread_index_in_simdgroup",
    "thread_index_in_threadgroup",
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threadgroups_per_grid",
    "threads_per_grid",
    "threads_per_simdgroup",
    "threads_per_threadgroup",
)

BASE_FLAGS = ["-std=c++17", "-O1", "-g", "-Wall", "-Werror", "-ffp-contract=off", "-fno-fast-math"]
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


class NotEmulated(Exception):
    """The kernel uses something the emulation cannot run faithfully."""


class KernelRunError(Exception):
    """The emulated kernel crashed, tripped a sanitizer, or broke a driver check."""


def compiler() -> str | None:
    """The g++ executable, or None."""
    return shutil.which(os.environ.get("CXX", "g++"))


def used_attributes(source: str) -> list[tuple[str, str]]:
    """(type, name) of the thread attributes MLX would put in the signature."""
    attributes = []
    for name in ALL_ATTRIBUTES:
        if name in source:
            if name not in EMULATED_ATTRIBUTES:
                raise NotEmulated(f"attribute {name} needs threadgroups, not emulated")
            attributes.append((EMULATED_ATTRIBUTES[name], name))
    return attributes


def generate(
    spec: KernelSpec, input_dtypes: Sequence[mx.Dtype], output_dtypes: Sequence[mx.Dtype]
) -> str:
    """The C++ translation unit for one kernel (see the module docstring)."""
    for dtype in (*input_dtypes, *output_dtypes):
        if dtype not in C_TYPES:
            raise NotEmulated(f"dtype {dtype} is not emulated")
    params: list[str] = []
    args: list[str] = []
    for i, (name, dtype) in enumerate(zip(spec.input_names, input_dtypes)):
        c_type = C_TYPES[dtype][0]
        params.append(f"  const device {c_type}* {name}")
        args.append(f"reinterpret_cast<const {c_type}*>(in[{i}].data)")
        if f"{name}_shape" in spec.source:
            params.append(f"  const constant int* {name}_shape")
            args.append(f"in[{i}].shape.data()")
        if f"{name}_strides" in spec.source:
            params.append(f"  const constant int64_t* {name}_strides")
            args.append(f"in[{i}].strides.data()")
        if f"{name}_ndim" in spec.source:
            params.append(f"  const constant int& {name}_ndim")
            args.append(f"in[{i}].ndim")
    for o, (name, dtype) in enumerate(zip(spec.output_names, output_dtypes)):
        c_type = C_TYPES[dtype][0]
        params.append(f"  device {c_type}* {name}")
        args.append(f"reinterpret_cast<{c_type}*>(out[{o}].data)")
    for c_type, name in used_attributes(spec.source):
        params.append(f"  {c_type} {name}")
        args.append("uint3{position[0], position[1], position[2]}")
        if name == "threads_per_grid":
            args[-1] = "uint3{grid[0], grid[1], grid[2]}"
    input_sizes = ", ".join(str(np.dtype(C_TYPES[d][1]).itemsize) for d in input_dtypes)
    output_sizes = ", ".join(str(np.dtype(C_TYPES[d][1]).itemsize) for d in output_dtypes)
    signature = ",\n".join(params)
    call = ",\n      ".join(args)
    return f"""// Generated by tests/kernel_harness/emulate.py for {spec.name}.
#include "driver.h"
#include "metal_compat.h"

// ---- header, verbatim ----
{spec.header}
// ---- kernel: MLX's signature, body verbatim ----
void {spec.name}(
{signature}) {{
{spec.source}
}}

static void run_thread(RedrafterBuffer* in, RedrafterBuffer* out, const unsigned* position,
                       const unsigned* grid) {{
  (void)grid;
  {spec.name}(
      {call});
}}

int main() {{
  const int input_sizes[] = {{{input_sizes}}};
  const int output_sizes[] = {{{output_sizes}}};
  return redrafter_drive({len(input_dtypes)}, input_sizes, {len(output_dtypes)}, output_sizes,
                         run_thread);
}}
"""


class Emulator:
    """Builds and runs emulated kernels; `launch` stands in for `metal_launch`."""

    def __init__(
        self,
        build_dir: Path | None = None,
        sanitize: bool = True,
        replace: Mapping[str, KernelSpec] | None = None,
    ):
        self.cxx = compiler()
        if self.cxx is None:
            raise NotEmulated("g++ not found")
        uid = os.getuid() if hasattr(os, "getuid") else 0
        self.build_dir = build_dir or Path(tempfile.gettempdir()) / f"mlx-redrafter-kernels-{uid}"
        self.build_dir.mkdir(parents=True, exist_ok=True)
        self.flags = BASE_FLAGS + (SANITIZE_FLAGS if sanitize and self._sanitizers() else [])
        self.replace = dict(replace or {})
        self.launches: list[str] = []  # kernel names, in launch order

    def with_replacements(self, replace: Mapping[str, KernelSpec]) -> Emulator:
        """An emulator that runs `replace[name]` wherever kernel `name` is launched."""
        other = Emulator.__new__(Emulator)
        other.__dict__.update(self.__dict__)
        other.replace = {**self.replace, **replace}
        other.launches = []
        return other

    def _sanitizers(self) -> bool:
        probe = self.build_dir / "probe.cpp"
        probe.write_text("int main() { return 0; }\n")
        result = subprocess.run(
            [str(self.cxx), *SANITIZE_FLAGS, str(probe), "-o", str(self.build_dir / "probe")],
            capture_output=True,
        )
        return result.returncode == 0

    @property
    def sanitized(self) -> bool:
        return SANITIZE_FLAGS[0] in self.flags

    def build(
        self,
        spec: KernelSpec,
        input_dtypes: Sequence[mx.Dtype],
        output_dtypes: Sequence[mx.Dtype],
    ) -> Path:
        """Compile (or reuse) the executable for a spec and dtypes."""
        text = generate(spec, input_dtypes, output_dtypes)
        digest = hashlib.sha256()
        for part in (text, (HERE / "metal_compat.h").read_text(), (HERE / "driver.h").read_text()):
            digest.update(part.encode())
        digest.update(" ".join(self.flags).encode())
        key = digest.hexdigest()[:16]
        binary = self.build_dir / f"{spec.name}-{key}"
        if binary.exists():
            return binary
        source = self.build_dir / f"{spec.name}-{key}.cpp"
        source.write_text(text)
        partial = binary.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run(
            [str(self.cxx), *self.flags, "-I", str(HERE), str(source), "-o", str(partial)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise KernelRunError(f"g++ failed on {spec.name}:\n{result.stderr}")
        partial.replace(binary)
        return binary

    def run_cases(
        self,
        spec: KernelSpec,
        cases: Sequence[tuple[Sequence[np.ndarray], Sequence[tuple[int, ...]], tuple[int, ...]]],
        output_dtypes: Sequence[mx.Dtype],
    ) -> list[list[np.ndarray]]:
        """Run many (inputs, output_shapes, grid) cases of one kernel in one process."""
        if not cases:
            return []
        input_dtypes = [_mx_dtype(x.dtype) for x in cases[0][0]]
        binary = self.build(spec, input_dtypes, output_dtypes)
        payload = [struct.pack("=i", len(cases))]
        for inputs, output_shapes, grid in cases:
            if any(g < 1 for g in grid):
                raise NotEmulated(f"empty grid {grid}")
            payload.append(struct.pack("=3i", *grid))
            for x, dtype in zip(inputs, input_dtypes):
                if x.ndim == 0:
                    raise NotEmulated("0-d inputs (passed by reference) are not emulated")
                data = np.ascontiguousarray(x, dtype=C_TYPES[dtype][1])
                payload.append(struct.pack(f"=i{x.ndim}i", x.ndim, *x.shape) + data.tobytes())
            for shape in output_shapes:
                payload.append(struct.pack(f"=i{len(shape)}i", len(shape), *shape))
        # The sanitizer runtime must be the first library loaded: drop any preload (the
        # test command preloads OpenBLAS for MLX, which these binaries do not use).
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0"
        result = subprocess.run(
            [str(binary)], input=b"".join(payload), capture_output=True, env=env
        )
        if result.returncode != 0:
            raise KernelRunError(
                f"{spec.name} exited with {result.returncode}:\n{result.stderr.decode()[-3000:]}"
            )
        outputs, offset = [], 0
        for _, output_shapes, _ in cases:
            row = []
            for shape, dtype in zip(output_shapes, output_dtypes):
                np_dtype = np.dtype(C_TYPES[dtype][1])
                size = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
                row.append(
                    np.frombuffer(result.stdout[offset : offset + size], np_dtype).reshape(shape)
                )
                offset += size
            outputs.append(row)
        if offset != len(result.stdout):
            raise KernelRunError(
                f"{spec.name}: {len(result.stdout) - offset} unexpected output bytes"
            )
        return outputs

    def launch(
        self,
        spec: KernelSpec,
        inputs: Sequence[mx.array],
        output_shapes: Sequence[tuple[int, ...]],
        output_dtypes: Sequence[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
    ) -> list[mx.array]:
        """`metal_launch`'s contract, on the CPU. The threadgroup only has to be valid:
        kernels without threadgroup memory or barriers do not depend on it."""
        if threadgroup[0] * threadgroup[1] * threadgroup[2] > 1024 or min(threadgroup) < 1:
            raise KernelRunError(f"invalid threadgroup {threadgroup}")
        spec = self.replace.get(spec.name, spec)
        self.launches.append(spec.name)
        arrays = [np.array(x) for x in inputs]
        (outputs,) = self.run_cases(spec, [(arrays, output_shapes, grid)], output_dtypes)
        return [mx.array(x) for x in outputs]


def _mx_dtype(dtype: np.dtype) -> mx.Dtype:
    for mx_dtype, (_, np_dtype) in C_TYPES.items():
        if np.dtype(np_dtype) == dtype:
            return mx_dtype
    raise NotEmulated(f"dtype {dtype} is not emulated")

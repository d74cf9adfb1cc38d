// Host driver for emulated Metal kernels: reads cases from stdin, runs every
// thread of the grid, writes the outputs to stdout.
//
// Protocol (native-endian int32 unless noted):
//   stdin:  num_cases, then per case: grid[3]; per input: ndim, shape[ndim], raw
//           bytes; per output: ndim, shape[ndim].
//   stdout: per case, per output: raw bytes.
// Every case runs twice: threads in grid order over outputs pre-filled with 0xA5
// bytes, then in reverse order over outputs pre-filled with 0x5A. The two results
// must be byte-identical, otherwise some output element was never written or a
// thread's result depends on another's (exit code 3).
// Each array lives in its own exact-size allocation, so AddressSanitizer (when
// the harness builds with it) reports any out-of-bounds access.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

struct RedrafterBuffer {
  std::vector<int> shape;
  std::vector<int64_t> strides;
  int ndim = 0;
  size_t nbytes = 0;
  unsigned char* data = nullptr;
};

typedef void (*RedrafterRunThread)(RedrafterBuffer* inputs, RedrafterBuffer* outputs,
                                   const unsigned* position, const unsigned* grid);

static int redrafter_read_int() {
  int32_t value = 0;
  if (std::fread(&value, sizeof(value), 1, stdin) != 1) {
    std::fprintf(stderr, "driver: truncated input\n");
    std::exit(2);
  }
  return value;
}

static void redrafter_read_shape(RedrafterBuffer& buffer, size_t element_size) {
  buffer.ndim = redrafter_read_int();
  buffer.shape.assign(buffer.ndim, 0);
  buffer.strides.assign(buffer.ndim, 0);
  size_t count = 1;
  for (int i = 0; i < buffer.ndim; ++i) {
    buffer.shape[i] = redrafter_read_int();
    count *= static_cast<size_t>(buffer.shape[i]);
  }
  int64_t stride = 1;
  for (int i = buffer.ndim - 1; i >= 0; --i) {
    buffer.strides[i] = stride;
    stride *= buffer.shape[i];
  }
  buffer.nbytes = count * element_size;
  buffer.data = static_cast<unsigned char*>(std::malloc(buffer.nbytes ? buffer.nbytes : 1));
}

static void redrafter_run_grid(RedrafterRunThread run, RedrafterBuffer* inputs,
                               RedrafterBuffer* outputs, const unsigned* grid, bool reverse) {
  const size_t total = static_cast<size_t>(grid[0]) * grid[1] * grid[2];
  for (size_t n = 0; n < total; ++n) {
    const size_t i = reverse ? total - 1 - n : n;
    const unsigned position[3] = {static_cast<unsigned>(i % grid[0]),
                                  static_cast<unsigned>((i / grid[0]) % grid[1]),
                                  static_cast<unsigned>(i / (static_cast<size_t>(grid[0]) * grid[1]))};
    run(inputs, outputs, position, grid);
  }
}

static int redrafter_drive(int num_inputs, const int* input_sizes, int num_outputs,
                           const int* output_sizes, RedrafterRunThread run) {
  const int num_cases = redrafter_read_int();
  for (int c = 0; c < num_cases; ++c) {
    unsigned grid[3];
    for (int d = 0; d < 3; ++d) {
      grid[d] = static_cast<unsigned>(redrafter_read_int());
    }
    std::vector<RedrafterBuffer> inputs(num_inputs), first(num_outputs), second(num_outputs);
    for (int i = 0; i < num_inputs; ++i) {
      redrafter_read_shape(inputs[i], input_sizes[i]);
      if (inputs[i].nbytes && std::fread(inputs[i].data, 1, inputs[i].nbytes, stdin) !=
                                   inputs[i].nbytes) {
        std::fprintf(stderr, "driver: truncated input data\n");
        return 2;
      }
    }
    for (int o = 0; o < num_outputs; ++o) {
      redrafter_read_shape(first[o], output_sizes[o]);
      second[o].shape = first[o].shape;
      second[o].strides = first[o].strides;
      second[o].ndim = first[o].ndim;
      second[o].nbytes = first[o].nbytes;
      second[o].data = static_cast<unsigned char*>(std::malloc(first[o].nbytes ? first[o].nbytes : 1));
      std::memset(first[o].data, 0xA5, first[o].nbytes);
      std::memset(second[o].data, 0x5A, second[o].nbytes);
    }
    redrafter_run_grid(run, inputs.data(), first.data(), grid, false);
    redrafter_run_grid(run, inputs.data(), second.data(), grid, true);
    for (int o = 0; o < num_outputs; ++o) {
      if (std::memcmp(first[o].data, second[o].data, first[o].nbytes) != 0) {
        std::fprintf(stderr,
                     "driver: case %d output %d differs between runs (an output element "
                     "was not written, or threads depend on each other)\n",
                     c, o);
        return 3;
      }
      std::fwrite(first[o].data, 1, first[o].nbytes, stdout);
    }
    for (auto& b : inputs) std::free(b.data);
    for (auto& b : first) std::free(b.data);
    for (auto& b : second) std::free(b.data);
  }
  std::fflush(stdout);
  return 0;
}

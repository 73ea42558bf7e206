// Element types, reductions and algorithms understood by the native layer.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gloo/allreduce.h>

namespace tnt_gloo {

enum class DType : std::uint8_t { kFloat16, kFloat32, kFloat64, kInt32, kInt64 };
enum class ReduceOp : std::uint8_t { kSum, kMin, kMax, kProduct };
// kRing and kBcube are Gloo's; kDoubling is recursive doubling over Gloo's transport
// (log2(p) full-buffer exchanges; power-of-two groups only), for the smallest buffers.
enum class Algorithm : std::uint8_t { kRing, kBcube, kDoubling };

// Parsers for the names the Python layer passes ("float32", "sum", "ring"); they throw
// GlooError naming the accepted values, so a typo in Python cannot reach Gloo.
DType parse_dtype(const std::string& name);
ReduceOp parse_op(const std::string& name);
Algorithm parse_algorithm(const std::string& name);

std::size_t element_size(DType dtype);
const char* dtype_name(DType dtype);

// The element-wise reduction Gloo's allreduce calls: out[i] = a[i] (op) b[i].
gloo::AllreduceOptions::Func reduce_function(DType dtype, ReduceOp op);

// dst[i] = src[i] * T(factor), as numpy's multiply(src, dtype.type(factor)) computes it (a
// framework's own scaled copy: tnt-keras' reducer pushes the same bits), for a factor other
// than 0 and 1 (the callers copy or clear for those).
void scale_copy(DType dtype, void* dst, const void* src, std::size_t n, double factor);

// One piece of an allreduce's input gathered from several buffers (the native table's
// allreduce_gather_async): `count` elements at `src`, placed at element `offset`.
struct Piece {
  const void* src;
  std::size_t offset;
  std::size_t count;
};

// Fill elements [first, first + n) of the input made of `pieces` (sorted by offset, not
// overlapping) into `dst`: each piece's part times `factor` (0: zeros, 1: `copy`, else
// `scale`), zeros where no piece is. `copy(dst, src, bytes)` and `scale(dst, src, count,
// factor)` (scale_copy's result) write the way the transport chooses, e.g. past the caches.
template <typename Copy, typename Scale>
void fill_gathered(char* dst, std::size_t first, std::size_t n, const std::vector<Piece>& pieces,
                   double factor, DType dtype, Copy&& copy, Scale&& scale) {
  const std::size_t es = element_size(dtype);
  std::size_t at = first;  // the next element of [first, first + n) not yet written
  const std::size_t end = first + n;
  for (const Piece& p : pieces) {
    if (p.offset + p.count <= at) continue;
    if (p.offset >= end) break;
    const std::size_t lo = std::max(at, p.offset), hi = std::min(end, p.offset + p.count);
    if (lo > at) std::memset(dst + (at - first) * es, 0, (lo - at) * es);
    char* to = dst + (lo - first) * es;
    const char* from = static_cast<const char*>(p.src) + (lo - p.offset) * es;
    if (factor == 1.0) {
      copy(to, from, (hi - lo) * es);
    } else if (factor == 0.0) {  // zeros, never 0 * (a stand-in's NaN)
      std::memset(to, 0, (hi - lo) * es);
    } else {
      scale(to, from, hi - lo, factor);
    }
    at = hi;
  }
  if (at < end) std::memset(dst + (at - first) * es, 0, (end - at) * es);
}

}  // namespace tnt_gloo

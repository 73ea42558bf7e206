// Element types, reductions and algorithms understood by the native layer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

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

}  // namespace tnt_gloo

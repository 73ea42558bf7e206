// The one native exception type of tnt_comm_gloo and the choke point that produces it.
//
// Every failure inside a Gloo call (transport errors, timeouts, enforce failures, store
// errors) is turned into a GlooError message by describe_exception(); the Python layer
// turns GlooError into tnt_core.CommError naming rank and operation.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

namespace tnt_gloo {

class GlooError : public std::runtime_error {
 public:
  explicit GlooError(const std::string& message) : std::runtime_error(message) {}
};

// A one-line description of the exception held by `error` (never throws).
std::string describe_exception(const std::exception_ptr& error) noexcept;

}  // namespace tnt_gloo

#include "errors.h"

#include <gloo/common/error.h>
#include <gloo/common/logging.h>

namespace tnt_gloo {
namespace {

// Gloo prefixes messages with "[/build/path/to/file.cc:123] "; keep only "file.cc:123".
std::string shorten(std::string message) {
  if (message.size() > 1 && message[0] == '[') {
    const auto close = message.find("] ");
    if (close != std::string::npos) {
      std::string where = message.substr(1, close - 1);
      const auto slash = where.rfind('/');
      if (slash != std::string::npos) where = where.substr(slash + 1);
      message = message.substr(close + 2) + " (gloo " + where + ")";
    }
  }
  while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) {
    message.pop_back();
  }
  return message;
}

}  // namespace

std::string describe_exception(const std::exception_ptr& error) noexcept {
  try {
    try {
      std::rethrow_exception(error);
    } catch (const GlooError& e) {
      return e.what();
    } catch (const ::gloo::IoException& e) {
      return "transport error: " + shorten(e.what());
    } catch (const ::gloo::InvalidOperationException& e) {
      return "invalid operation: " + shorten(e.what());
    } catch (const ::gloo::Exception& e) {
      return shorten(e.what());
    } catch (const ::gloo::EnforceNotMet& e) {
      return "gloo internal check failed: " + shorten(e.what());
    } catch (const std::bad_alloc&) {
      return "out of memory";
    } catch (const std::exception& e) {
      return shorten(e.what());
    } catch (...) {
      return "unknown native error";
    }
  } catch (...) {
    return "unknown native error (describing it failed)";
  }
}

}  // namespace tnt_gloo

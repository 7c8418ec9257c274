// Helpers shared by the single-process tests.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "torchspeed/runtime/error.h"

namespace ts_test {

// `fn` must throw a torchspeed::Error whose message contains `needle`.
inline void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing: " << needle;
  } catch (const torchspeed::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace ts_test

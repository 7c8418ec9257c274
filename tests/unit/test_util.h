// Helpers shared by the single-process tests.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "torchspeed/config/config.h"
#include "torchspeed/base/error.h"

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

// Every message of the ConfigError `parse` throws, one per line; "" when it parses.
inline std::string config_errors(const std::function<void()>& parse) {
  try {
    parse();
  } catch (const torchspeed::config::ConfigError& e) {
    std::string all;
    for (const auto& m : e.errors()) all += m + "\n";
    return all;
  }
  return "";
}

}  // namespace ts_test

// Shared by the GPU tests: skip (never pass vacuously) without a usable sm_90 device.
#pragma once

#include <gtest/gtest.h>

#include "flamia/device.h"

#define FLAMIA_REQUIRE_GPU()                                                         \
  do {                                                                               \
    static const ::flamia::DeviceInfo flamia_device_info = ::flamia::query_device(); \
    if (!flamia_device_info.available) GTEST_SKIP() << flamia_device_info.reason;    \
  } while (0)

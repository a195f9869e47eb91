// The benchmark's nvcc probes (bench/*.cu): CHECK(call) stops the program with the call's text,
// line and status where a CUDA runtime, driver or cuBLAS call fails (each reports 0 on success).
#pragma once

#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                      \
  do {                                                                                   \
    const int status = static_cast<int>(call);                                           \
    if (status != 0) {                                                                   \
      std::fprintf(stderr, "%s failed (%d) at line %d\n", #call, status, __LINE__);      \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

# cmake -P script: configuring torchspeed with the wheel's TorchConfig.cmake (Torch_DIR) while
# Debian's LibTorch 1.13 is installed mixes 2.x headers with 1.13 libraries (Note [One LibTorch]);
# the configure must fail and say so. (The CTest wrapper skips, exit 77, without Debian's LibTorch.)
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR} -G ${GENERATOR}
                        -DTorch_DIR=${TORCH_PREFIX}/share/cmake/Torch -DTORCHSPEED_TORCH_DIR=
                        -DTORCHSPEED_BUILD_TESTS=OFF -DTORCHSPEED_BUILD_TOOLS=OFF
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
file(REMOVE_RECURSE ${WORK_DIR})
if(rc EQUAL 0)
  message(FATAL_ERROR "configuring with the wheel's Torch_DIR next to Debian's LibTorch succeeded; it must refuse the mix")
endif()
string(REGEX REPLACE "[ \n]+" " " err "${err}")
if(NOT err MATCHES "two LibTorch installs are mixed.*The headers are LibTorch 2\\.[0-9.]+ from .*TORCHSPEED_TORCH_DIR")
  message(FATAL_ERROR "the configure failed, but not with the mix error:\n${err}")
endif()
message("refused as expected: ${err}")

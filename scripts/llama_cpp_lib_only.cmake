# Included right after llama.cpp's own project() call (CMAKE_PROJECT_llama.cpp_INCLUDE) when the Makefile
# builds llama-cpp-python: its CMakeLists forces LLAMA_BUILD_COMMON on, but exactspec binds libllama alone,
# so the common library (chat templates, HTTP, argument parsing) is not compiled.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama: build common utils library" FORCE)

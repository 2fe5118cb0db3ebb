/* A stand-in for the NVIDIA driver library, libcuda.so.1, for tests on machines without one.
 *
 * cuDNN's backend API loads all its engine sub-libraries on the first cudnnBackendFinalize, and one of them
 * (libcudnn_engines_runtime_compiled.so.9) links libcuda.so.1. Without that file every finalize fails with
 * CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED, for the rest of the process (docs/deviceless.md). These are the only
 * driver functions that sub-library imports; each fails as the driver does without a device. Nothing here can
 * run a kernel: it lets cuDNN build descriptors, operation graphs and plans against device properties. */
#define CUDA_ERROR_NO_DEVICE 100

int cuGetErrorString(int error, const char **text) {
    static const char message[] = "no CUDA driver (a test stand-in for libcuda.so.1)";
    (void)error;
    if (text) *text = message;
    return 0;
}
int cuModuleGetFunction(void *function, void *module, const char *name) {
    (void)function; (void)module; (void)name;
    return CUDA_ERROR_NO_DEVICE;
}
int cuModuleLoadData(void *module, const void *image) {
    (void)module; (void)image;
    return CUDA_ERROR_NO_DEVICE;
}
int cuModuleUnload(void *module) {
    (void)module;
    return CUDA_ERROR_NO_DEVICE;
}
int cuTensorMapEncodeIm2col(void) { return CUDA_ERROR_NO_DEVICE; }
int cuTensorMapEncodeTiled(void) { return CUDA_ERROR_NO_DEVICE; }

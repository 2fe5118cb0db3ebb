/* A stand-in for the NVIDIA driver library, libcuda.so.1, for tests on machines without one.
 *
 * cuDNN's backend API loads all its engine sub-libraries on the first cudnnBackendFinalize, and one of them
 * (libcudnn_engines_runtime_compiled.so.9) links libcuda.so.1. Without that file every finalize fails with
 * CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED, for the rest of the process (docs/deviceless.md). These are the only
 * driver functions that sub-library imports, and those cuDNN looks up by name as it plans (it prints a line for
 * each one it cannot find); each fails as the driver does without a device. Nothing here can run a kernel: it
 * lets cuDNN build descriptors, operation graphs and plans against device properties. */
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

/* Looked up by name; called only where a device would run something. Their arguments are never read. */
int cuCtxGetCurrent(void) { return CUDA_ERROR_NO_DEVICE; }
int cuCtxGetLimit(void) { return CUDA_ERROR_NO_DEVICE; }
int cuCtxPopCurrent(void) { return CUDA_ERROR_NO_DEVICE; }
int cuCtxPushCurrent(void) { return CUDA_ERROR_NO_DEVICE; }
int cuDeviceGet(void) { return CUDA_ERROR_NO_DEVICE; }
int cuDeviceGetCount(void) { return CUDA_ERROR_NO_DEVICE; }
int cuDriverGetVersion(void) { return CUDA_ERROR_NO_DEVICE; }
int cuGetErrorName(void) { return CUDA_ERROR_NO_DEVICE; }
int cuKernelGetAttribute(void) { return CUDA_ERROR_NO_DEVICE; }
int cuKernelGetFunction(void) { return CUDA_ERROR_NO_DEVICE; }
int cuKernelSetAttribute(void) { return CUDA_ERROR_NO_DEVICE; }
int cuLaunchCooperativeKernel(void) { return CUDA_ERROR_NO_DEVICE; }
int cuLaunchKernel(void) { return CUDA_ERROR_NO_DEVICE; }
int cuLaunchKernelEx(void) { return CUDA_ERROR_NO_DEVICE; }
int cuLibraryGetKernel(void) { return CUDA_ERROR_NO_DEVICE; }
int cuLibraryLoadData(void) { return CUDA_ERROR_NO_DEVICE; }
int cuLibraryLoadFromFile(void) { return CUDA_ERROR_NO_DEVICE; }
int cuLibraryUnload(void) { return CUDA_ERROR_NO_DEVICE; }
int cuLinkAddData(void) { return CUDA_ERROR_NO_DEVICE; }
int cuLinkComplete(void) { return CUDA_ERROR_NO_DEVICE; }
int cuLinkCreate(void) { return CUDA_ERROR_NO_DEVICE; }
int cuLinkDestroy(void) { return CUDA_ERROR_NO_DEVICE; }
int cuOccupancyMaxPotentialClusterSize(void) { return CUDA_ERROR_NO_DEVICE; }
int cuStreamGetCtx(void) { return CUDA_ERROR_NO_DEVICE; }

// Links dtrain::torch_cuda and calls nothing of it (see tests/gpu/CMakeLists.txt).
int main() { return 0; }

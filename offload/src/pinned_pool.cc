// Placeholder translation unit until the pinned host pool lands (issue: CPU offload).
namespace dtrain::offload {}

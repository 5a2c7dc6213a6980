#include "dtrain/dist/mesh.h"

#include <set>

#include "dtrain/dist/error.h"

namespace dtrain::dist {
namespace {

std::vector<MeshAxis> standard_axes(int tp, int pp, int cp) {
  if (cp == 1) return {{"pp", pp}, {"dp", -1}, {"tp", tp}};
  return {{"pp", pp}, {"dp", -1}, {"cp", cp}, {"tp", tp}};
}

std::string flag(const MeshAxis& a) { return "--" + a.name + "=" + std::to_string(a.size); }

}  // namespace

std::vector<MeshAxis> Mesh::check(int world_size, std::vector<MeshAxis> axes) {
  DTRAIN_CHECK(!axes.empty(), "a mesh needs at least one axis");
  std::set<std::string> names;
  int open = -1;
  int64_t fixed = 1;
  for (size_t i = 0; i < axes.size(); ++i) {
    const MeshAxis& a = axes[i];
    DTRAIN_CHECK(!a.name.empty() && names.insert(a.name).second, "mesh axis '", a.name,
                 "' is empty or given twice; every axis needs a name of its own");
    if (a.size == -1) {
      DTRAIN_CHECK(open < 0, "mesh axes '", axes[static_cast<size_t>(open)].name, "' and '", a.name,
                   "' both take the rest of the world (size -1); give one of them a size");
      open = static_cast<int>(i);
      continue;
    }
    DTRAIN_CHECK(a.size >= 1, "--", a.name, "=", a.size, " must be at least 1");
    DTRAIN_CHECK(a.size <= world_size, flag(a), " is larger than the world (", world_size, " ranks); start at least ",
                 a.size, " processes", a.name == "pp" ? " (one per pipeline stage)" : "", " or lower --", a.name);
    fixed *= a.size;
  }
  if (world_size % fixed != 0) {
    // The axes of more than one rank, innermost first, as the flags name them.
    std::vector<const MeshAxis*> split;
    for (auto it = axes.rbegin(); it != axes.rend(); ++it) {
      if (it->size > 1) split.push_back(&*it);
    }
    if (split.size() == 1) {
      throw Error(detail::concat(flag(*split[0]), " does not divide the world size ", world_size,
                                 "; use a world size that is a multiple of ", fixed,
                                 open >= 0 && split[0]->name != "tp" ? " (the rest of the world is data-parallel)" : ""));
    }
    std::string product;
    for (const MeshAxis* a : split) product += (product.empty() ? "" : " x ") + flag(*a);
    throw Error(detail::concat(product, " = ", fixed, " does not divide the world size ", world_size,
                               "; use a world size that is a multiple of ", fixed,
                               open >= 0 ? " (the rest of the world is data-parallel)" : ""));
  }
  if (open >= 0) {
    axes[static_cast<size_t>(open)].size = static_cast<int>(world_size / fixed);
  } else {
    DTRAIN_CHECK(fixed == world_size, "the mesh axes hold ", fixed, " ranks but the world has ", world_size,
                 "; give one axis size -1 (the rest of the world) or sizes whose product is the world");
  }
  return axes;
}

void Mesh::check(int world_size, int tp, int pp, int cp) { check(world_size, standard_axes(tp, pp, cp)); }

Mesh::Mesh(Communicator& world, int tensor_parallel, int pipeline_parallel, int context_parallel)
    : Mesh(world, standard_axes(tensor_parallel, pipeline_parallel, context_parallel)) {}

Mesh::Mesh(Communicator& world, std::vector<MeshAxis> axes) : world_(&world), axes_(check(world.size(), std::move(axes))) {
  const int n = static_cast<int>(axes_.size());
  // stride[i]: ranks between neighbours along axis i (the innermost axis: 1).
  std::vector<int> stride(static_cast<size_t>(n), 1);
  for (int i = n - 2; i >= 0; --i) stride[static_cast<size_t>(i)] = stride[static_cast<size_t>(i) + 1] * axes_[static_cast<size_t>(i) + 1].size;
  const int r = world.rank();
  groups_.assign(static_cast<size_t>(n), nullptr);
  Communicator* alone = nullptr;  // this rank by itself, shared by every axis of one rank
  for (int i = n - 1; i >= 0; --i) {  // innermost first
    const MeshAxis& a = axes_[static_cast<size_t>(i)];
    const int s = stride[static_cast<size_t>(i)];
    const int coordinate = r / s % a.size;
    // The group: the ranks with every other coordinate equal. Its number counts the groups in
    // rank order (the other coordinates read as one number).
    const int outer = r / (s * a.size), inner = r % s;
    const int color = outer * s + inner;
    if (a.size == 1 && alone) {
      groups_[static_cast<size_t>(i)] = alone;
      continue;
    }
    owned_.push_back(world.split(color, coordinate, a.name + std::to_string(color)));
    groups_[static_cast<size_t>(i)] = owned_.back().get();
    if (a.size == 1) alone = owned_.back().get();
  }
  // A standard axis the mesh lacks: this rank alone.
  for (Communicator** slot : {&tp_, &dp_, &pp_, &cp_}) {
    const std::string name = slot == &tp_ ? "tp" : slot == &dp_ ? "dp" : slot == &pp_ ? "pp" : "cp";
    for (int i = 0; i < n; ++i) {
      if (axes_[static_cast<size_t>(i)].name == name) *slot = groups_[static_cast<size_t>(i)];
    }
    if (*slot) continue;
    if (!alone) {
      owned_.push_back(world.split(r, 0, "self" + std::to_string(r)));
      alone = owned_.back().get();
    }
    *slot = alone;
  }
  replicas_ = dp_;
  if (cp_->size() > 1) {
    // dp x cp: the ranks whose coordinates differ only along dp or cp. Color: the rank with
    // those two coordinates set to zero; key: (dp rank, cp rank) in mixed radix.
    int color = r;
    for (int i = 0; i < n; ++i) {
      const MeshAxis& a = axes_[static_cast<size_t>(i)];
      if (a.name == "dp" || a.name == "cp") color -= r / stride[static_cast<size_t>(i)] % a.size * stride[static_cast<size_t>(i)];
    }
    const int key = dp_->rank() * cp_->size() + cp_->rank();
    owned_.push_back(world.split(color, key, "replicas" + std::to_string(color)));
    replicas_ = owned_.back().get();
  }
}

Communicator& Mesh::group(const std::string& axis) const {
  for (size_t i = 0; i < axes_.size(); ++i) {
    if (axes_[i].name == axis) return *groups_[i];
  }
  std::string known;
  for (const MeshAxis& a : axes_) known += (known.empty() ? "" : ", ") + a.name;
  throw Error(detail::concat("the mesh has no axis '", axis, "' (its axes: ", known, ")"));
}

bool Mesh::has(const std::string& axis) const {
  for (const MeshAxis& a : axes_) {
    if (a.name == axis) return true;
  }
  return false;
}

}  // namespace dtrain::dist

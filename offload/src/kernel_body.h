// Private: the update loops shared by the ISA-specific kernel files. Each kernel_<isa>.cc
// defines a vector-traits struct V inside an anonymous namespace and then includes this
// header inside the same anonymous namespace, so every function here has internal linkage:
// code compiled with AVX-512 flags can never be picked by the linker for another file
// (no shared inline functions across target flags).
//
// V provides: Reg, kWidth, set1, load_f32/store_f32 (float*), load_bf16/load_f16 and
// store_bf16/store_f16 (uint16_t*), add, sub, mul, div, sqrt, max, fma(a, b, c) = a*b + c and
// fnma(a, b, c) = c - a*b. Loads and stores are unaligned.
//
// Contract of the entry point dispatch<V>(config, arrays): see cpu_kernels.h.

template <ElemType T>
inline typename V::Reg load_as_float(const void* base, int64_t i) {
  if constexpr (T == ElemType::kFloat32) {
    return V::load_f32(static_cast<const float*>(base) + i);
  } else if constexpr (T == ElemType::kBFloat16) {
    return V::load_bf16(static_cast<const uint16_t*>(base) + i);
  } else {
    return V::load_f16(static_cast<const uint16_t*>(base) + i);
  }
}

template <ElemType T>
inline void store_from_float(void* base, int64_t i, typename V::Reg x) {
  if constexpr (T == ElemType::kFloat32) {
    V::store_f32(static_cast<float*>(base) + i, x);
  } else if constexpr (T == ElemType::kBFloat16) {
    V::store_bf16(static_cast<uint16_t*>(base) + i, x);
  } else if constexpr (T == ElemType::kFloat16) {
    V::store_f16(static_cast<uint16_t*>(base) + i, x);
  }
}

inline int elem_bytes(ElemType t) {
  return t == ElemType::kNone ? 0 : (t == ElemType::kFloat32 ? 4 : 2);
}

// What every rule does first, with its constants: vector i's gradient scaled by
// grad_multiplier (plus L2 weight decay times the parameter), and the parameter's decoupled
// weight decay. Constants are broadcast once per call.
struct DecayConsts {
  using R = typename V::Reg;
  bool has_l2, has_decay;
  R gm, l2, decay;
  explicit DecayConsts(const UpdateConfig& c)
      : has_l2(c.l2_weight_decay != 0.0f),
        has_decay(c.param_decay != 1.0f),
        gm(V::set1(c.grad_multiplier)),
        l2(V::set1(c.l2_weight_decay)),
        decay(V::set1(c.param_decay)) {}
  // Vector i's parameter p (decayed) and gradient g (scaled, L2 added).
  template <ElemType G>
  inline void load(const UpdateArrays& a, int64_t i, R& p, R& g) const {
    p = V::load_f32(a.param + i);
    g = V::mul(load_as_float<G>(a.grad, i), gm);
    if (has_l2) g = V::fma(l2, p, g);
    if (has_decay) p = V::mul(p, decay);
  }
};

// The update of one vector at index i, per rule: Op::update takes the vector's parameter
// (decayed) and gradient (scaled, L2 added), updates the rule's state and returns the new
// parameter, which goes into the master and the model copy (when O is not kNone). Constants
// are broadcast once per call (Op::Consts, a template parameter here: Op is incomplete when
// this base is).
template <class Op, ElemType G, ElemType O>
struct RuleAt {
  template <class Consts>
  static inline void at(const Consts& c, const UpdateArrays& a, int64_t i) {
    typename V::Reg p, g;
    c.template load<G>(a, i, p, g);
    p = Op::update(c, a, i, p, g);
    V::store_f32(a.param + i, p);
    store_from_float<O>(a.out, i, p);
  }
};

template <ElemType G, ElemType O, bool kAmsgrad>
struct AdamOp : RuleAt<AdamOp<G, O, kAmsgrad>, G, O> {
  using R = typename V::Reg;
  struct Consts : DecayConsts {
    R b1c, b2, b2c, step, inv_bc2, eps;
    explicit Consts(const UpdateConfig& c)
        : DecayConsts(c),
          b1c(V::set1(c.one_minus_beta1)),
          b2(V::set1(c.beta2)),
          b2c(V::set1(c.one_minus_beta2)),
          step(V::set1(c.step_size)),
          inv_bc2(V::set1(c.inv_bias_correction2_sqrt)),
          eps(V::set1(c.eps)) {}
  };
  static inline R update(const Consts& c, const UpdateArrays& a, int64_t i, R p, R g) {
    R m = V::load_f32(a.state0 + i);
    m = V::fma(c.b1c, V::sub(g, m), m);
    R v = V::fma(c.b2c, V::mul(g, g), V::mul(c.b2, V::load_f32(a.state1 + i)));
    R vhat = v;
    if constexpr (kAmsgrad) {
      vhat = V::max(V::load_f32(a.state2 + i), v);
      V::store_f32(a.state2 + i, vhat);
    }
    R denom = V::fma(V::sqrt(vhat), c.inv_bc2, c.eps);
    p = V::fnma(c.step, V::div(m, denom), p);
    V::store_f32(a.state0 + i, m);
    V::store_f32(a.state1 + i, v);
    return p;
  }
};

template <ElemType G, ElemType O>
struct AdagradOp : RuleAt<AdagradOp<G, O>, G, O> {
  using R = typename V::Reg;
  struct Consts : DecayConsts {
    R lr, eps;
    explicit Consts(const UpdateConfig& c) : DecayConsts(c), lr(V::set1(c.lr)), eps(V::set1(c.eps)) {}
  };
  static inline R update(const Consts& c, const UpdateArrays& a, int64_t i, R p, R g) {
    R s = V::fma(g, g, V::load_f32(a.state0 + i));
    p = V::fnma(c.lr, V::div(g, V::add(V::sqrt(s), c.eps)), p);
    V::store_f32(a.state0 + i, s);
    return p;
  }
};

template <ElemType G, ElemType O, bool kMomentum>
struct SgdOp : RuleAt<SgdOp<G, O, kMomentum>, G, O> {
  using R = typename V::Reg;
  struct Consts : DecayConsts {
    bool first, nesterov;
    R lr, momentum, dampening_keep;
    explicit Consts(const UpdateConfig& c)
        : DecayConsts(c),
          first(c.first_step),
          nesterov(c.nesterov),
          lr(V::set1(c.lr)),
          momentum(V::set1(c.momentum_factor)),
          dampening_keep(V::set1(c.dampening_keep)) {}
  };
  static inline R update(const Consts& c, const UpdateArrays& a, int64_t i, R p, R g) {
    if constexpr (kMomentum) {
      R buf =
          c.first ? g : V::fma(c.momentum, V::load_f32(a.state0 + i), V::mul(c.dampening_keep, g));
      V::store_f32(a.state0 + i, buf);
      g = c.nesterov ? V::fma(c.momentum, buf, g) : buf;
    }
    return V::fnma(c.lr, g, p);
  }
};

// The last n < kWidth elements: copied into zero-filled local vectors, updated by one full
// vector step, copied back. Padding lanes compute on zeros and are discarded.
template <class Op>
void run_tail(const typename Op::Consts& c, const UpdateArrays& a, int64_t i) {
  constexpr int W = V::kWidth;
  const int64_t n = a.n - i;
  alignas(64) float p[W] = {}, s0[W] = {}, s1[W] = {}, s2[W] = {};
  alignas(64) unsigned char g[W * 4] = {}, o[W * 4] = {};
  const int gb = elem_bytes(a.grad_type), ob = elem_bytes(a.out_type);
  std::memcpy(p, a.param + i, n * 4);
  std::memcpy(g, static_cast<const unsigned char*>(a.grad) + i * gb, n * gb);
  if (a.state0) std::memcpy(s0, a.state0 + i, n * 4);
  if (a.state1) std::memcpy(s1, a.state1 + i, n * 4);
  if (a.state2) std::memcpy(s2, a.state2 + i, n * 4);
  UpdateArrays t = a;
  t.param = p;
  t.grad = g;
  t.state0 = s0;
  t.state1 = s1;
  t.state2 = s2;
  t.out = a.out ? o : nullptr;
  Op::at(c, t, 0);
  std::memcpy(a.param + i, p, n * 4);
  if (a.state0) std::memcpy(a.state0 + i, s0, n * 4);
  if (a.state1) std::memcpy(a.state1 + i, s1, n * 4);
  if (a.state2) std::memcpy(a.state2 + i, s2, n * 4);
  if (a.out) std::memcpy(static_cast<unsigned char*>(a.out) + i * ob, o, n * ob);
}

template <class Op>
void run_loop(const UpdateConfig& config, const UpdateArrays& a) {
  const typename Op::Consts c(config);
  constexpr int W = V::kWidth;
  int64_t i = 0;
  for (; i + W <= a.n; i += W) Op::at(c, a, i);
  if constexpr (W > 1) {
    if (i < a.n) run_tail<Op>(c, a, i);
  }
}

template <ElemType G, ElemType O>
void dispatch_kind(const UpdateConfig& c, const UpdateArrays& a) {
  switch (c.kind) {
    case OptimKind::kAdam:
      return c.amsgrad ? run_loop<AdamOp<G, O, true>>(c, a) : run_loop<AdamOp<G, O, false>>(c, a);
    case OptimKind::kAdagrad:
      return run_loop<AdagradOp<G, O>>(c, a);
    case OptimKind::kSgd:
      return c.momentum ? run_loop<SgdOp<G, O, true>>(c, a) : run_loop<SgdOp<G, O, false>>(c, a);
  }
}

template <ElemType G>
void dispatch_out(const UpdateConfig& c, const UpdateArrays& a) {
  switch (a.out_type) {
    case ElemType::kNone:
      return dispatch_kind<G, ElemType::kNone>(c, a);
    case ElemType::kFloat32:
      return dispatch_kind<G, ElemType::kFloat32>(c, a);
    case ElemType::kBFloat16:
      return dispatch_kind<G, ElemType::kBFloat16>(c, a);
    case ElemType::kFloat16:
      return dispatch_kind<G, ElemType::kFloat16>(c, a);
  }
}

// Entry point: the caller (cpu_kernels.cc / CpuOptimizer) has validated the arrays.
void dispatch(const UpdateConfig& c, const UpdateArrays& a) {
  if (a.n <= 0) return;
  switch (a.grad_type) {
    case ElemType::kBFloat16:
      return dispatch_out<ElemType::kBFloat16>(c, a);
    case ElemType::kFloat16:
      return dispatch_out<ElemType::kFloat16>(c, a);
    default:
      return dispatch_out<ElemType::kFloat32>(c, a);
  }
}

// fastformer::add_layer_norm: the eager training path of add_layer_norm with its autograd in C++.
// One differentiable op, registered for CompositeImplicitAutograd (so it runs under no_grad and
// inference_mode too, and on any device): its forward calls add_layer_norm_fwd (or .x_bias)
// through the dispatcher, its backward node (a hand-written torch::autograd::Node) add_layer_norm_bwd
// (or .x_bias); on the CPU, where the dispatcher would only pass the call on, the same kernels
// directly (dispatches_to_cpu, csrc/cpu/add_layer_norm_glue.h). It is fastformer/autograd/add_layer_norm.py's AddLayerNormFunction, step for step:
// the same kernels, saved tensors and special cases, with the caller drawing `philox` (the Python
// Function's philox.draw(dropout_p)) and passing it in.
#include <ATen/ATen.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorOptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include "../cpu/add_layer_norm_glue.h"
#include "../eager.h"
#include "kernel.h"

#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

namespace fastformer {
namespace {

using at::Tensor;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

using Fwd = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Bwd4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Bwd5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using OptTensor = std::optional<Tensor>;

// The kernels, looked up once.
using FwdSig = Fwd(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, double, double, const Tensor&,
                   bool);
using FwdXBiasSig = Fwd(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, double, double, const Tensor&,
                        const Tensor&, bool);
using Bwd4Sig = Bwd4(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                     double, const Tensor&, bool, bool);
using Bwd5Sig = Bwd5(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                     double, const Tensor&, bool, bool);
FF_KERNEL(fwd_op, FwdSig, "fastformer::add_layer_norm_fwd", "")
FF_KERNEL(fwd_x_bias_op, FwdXBiasSig, "fastformer::add_layer_norm_fwd", "x_bias")
FF_KERNEL(bwd_op, Bwd4Sig, "fastformer::add_layer_norm_bwd", "")
FF_KERNEL(bwd_x_bias_op, Bwd5Sig, "fastformer::add_layer_norm_bwd", "x_bias")

// Whether x's device has the .x_bias kernels (the Python: the backend's kernels have
// add_layer_norm_fwd_x_bias, i.e. add_layer_norm_fwd.x_bias has a kernel for its dispatch key: the
// CPU library does, the CUDA one does not). Asked once per device type: every kernel of the
// library is registered when it loads, before any call.
bool has_x_bias_kernels(const Tensor& x) {
  static std::atomic<int8_t> known[static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)];
  const auto type = static_cast<int>(x.device().type());
  int8_t v = known[type].load(std::memory_order_relaxed);
  if (v == 0) {
    const c10::DispatchKey key = c10::computeDispatchKey(std::nullopt, x.layout(), x.device());
    v = fwd_x_bias_op().hasKernelForDispatchKey(key) ? 1 : -1;
    known[type].store(v, std::memory_order_relaxed);
  }
  return v > 0;
}

// Whether the dispatcher would send a call on these tensors (undefined ones left out) straight to
// its CPU kernel, so that the glue may call that kernel itself (csrc/cpu/add_layer_norm_glue.h):
// the key it would pick (the tensors' keys with the thread's included, less its excluded: below
// autograd, no autocast; less BackendSelect, always included and a fallthrough for these ops) is
// CPU, so there is no mode, subclass, functorch layer, conjugate or negative view, or graph to
// record in between; and no RecordFunction callback (the profiler) would see the call, the
// dispatcher's own check (Dispatcher::call), so a profile keeps the kernels' events.
bool dispatches_to_cpu(std::initializer_list<const Tensor*> ts) {
  c10::DispatchKeySet ks;
  for (const Tensor* t : ts) {
    if (t->defined()) ks = ks | t->key_set();
  }
  const c10::impl::LocalDispatchKeySet tls = c10::impl::tls_local_dispatch_key_set();
  ks = ((ks | tls.included_) - tls.excluded_).remove(c10::DispatchKey::BackendSelect);
  return ks.highestPriorityTypeId() == c10::DispatchKey::CPU &&
         !at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION).has_value();
}
const Tensor& or_undefined(const OptTensor& t) {
  static const Tensor undefined;
  return t.has_value() ? *t : undefined;
}

// The forward kernel: add_layer_norm_fwd.x_bias when x_bias is given and x's device has it, else
// add_layer_norm_fwd of x + x_bias (or x). *fused: whether the .x_bias overload ran. On the CPU,
// where the dispatcher would only pass the call on, the kernel is called directly, with mean, rstd
// and (unless h_returned) h in one allocation, no tensors made for them (block), where no one sees
// that: they are only kept for the backward, and no saved-tensor hook is set, which would be handed
// them (add_layer_norm_fwd_glue_cpu). A caller that receives h (the registered op's, the entry's
// with prenorm) gets it in a storage of its own.
AddLayerNormFwdGlue run_forward(const Tensor& x, const OptTensor& residual, const Tensor& weight,
                                const Tensor& bias, double eps, double dropout_p, const Tensor& philox,
                                const OptTensor& x_bias, bool rms_norm, bool h_returned, bool* fused) {
  const bool has_x_bias = x_bias.has_value() && x_bias->defined();
  if (dispatches_to_cpu({&x, &or_undefined(residual), &weight, &bias, &philox, &or_undefined(x_bias)})) {
    *fused = has_x_bias;  // (the CPU library has the .x_bias kernels)
    const bool unseen = at::SavedTensorDefaultHooks::get_tls_state().stack.empty();
    return add_layer_norm_fwd_glue_cpu(x, residual, weight, bias, eps, dropout_p, philox,
                                       has_x_bias ? &*x_bias : nullptr, rms_norm, /*one_block=*/unseen,
                                       /*h_in_block=*/!h_returned);
  }
  *fused = has_x_bias && has_x_bias_kernels(x);
  Fwd out = *fused ? fwd_x_bias_op().call(x, residual, weight, bias, eps, dropout_p, philox, *x_bias, rms_norm)
                   : fwd_op().call(has_x_bias ? at::add(x, *x_bias) : x, residual, weight, bias, eps, dropout_p,
                                   philox, rms_norm);
  AddLayerNormFwdGlue glue;
  std::tie(glue.y, glue.h, glue.mean, glue.rstd) = std::move(out);
  return glue;
}

// x or residual (..., C) as the kernels' contiguous (N, C) rows: a view where it can be (below
// autograd: no node), a copy where the layout needs one. x's checks are the kernels' (a 0-d x or
// C = 0 is refused there, as the 2-D rows they are given would be).
Tensor as_rows(const Tensor& t) {
  if (t.dim() == 2 && t.is_contiguous()) return t;  // (the rows already: no second copy of the handle)
  TORCH_CHECK(t.dim() >= 1, "fastformer::add_layer_norm: x must have at least 1 dimension, got a 0-d tensor");
  return ff_rows(t).contiguous();
}
OptTensor as_rows(const OptTensor& t) {
  if (!t.has_value() || !t->defined()) return t;
  return as_rows(*t);
}

constexpr int64_t kResidual = 1, kXBias = 2, kFused = 4, kPrenorm = 8, kRms = 16;

// The backward node, written as torch's generated nodes are (NativeLayerNormBackward0): the saved
// tensors are SavedVariable members (version-checked, packed by saved-tensor hooks, released after
// the backward), the rest plain members. philox is kept as a plain tensor: it is the caller's fresh
// draw, never differentiable and never an activation (16 bytes; no kernel reads it at p = 0).
// Edges: x, residual, weight, bias, x_bias (an absent one an empty edge).
// The forward's block (run_forward's: mean, rstd, and h unless it is returned) is a plain member:
// no one else holds it, so there is no version to check, and no hook was set to hand it to (the
// block is made only then); the kernels read it at its offsets, no tensors are made for them (a
// SavedVariable and a view cost ~0.2k and ~0.4k instructions each to make, unpack and free).
// weight (the caller's) and a returned h stay SavedVariables.
struct AddLayerNormBackward final : public torch::autograd::Node {
  variable_list apply(variable_list&& grads) override;
  std::string name() const override { return "AddLayerNormBackward"; }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    h_.reset_data();
    weight_.reset_data();
    mean_.reset_data();
    rstd_.reset_data();
    block = Tensor();
  }
  SavedVariable h_, weight_, mean_, rstd_;  // h in x's shape (an output when prenorm)
  Tensor block;                             // in_block: mean, rstd at mean_at, rstd_at (bytes), h at 0 if h_in_block
  int64_t mean_at = 0, rstd_at = 0;
  bool in_block = false, h_in_block = false;
  Tensor philox;
  double dropout_p = 0.0;
  int64_t flags = 0;  // kResidual | kXBias | kFused | kPrenorm | kRms
};

variable_list AddLayerNormBackward::apply(variable_list&& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  // the saved tensors first: under activation checkpointing, unpacking them recomputes the
  // checkpointed forward, which must record its graph (and save its tensors) as the first time
  Tensor h, weight, mean, rstd;
  if (in_block) {  // weight_ first: after release_variables its unpack raises torch's "second time" error
    weight = weight_.unpack();
    if (!h_in_block) h = h_.unpack(getptr());
  } else {
    h = h_.unpack(getptr());
    weight = weight_.unpack();
    mean = mean_.unpack();
    rstd = rstd_.unpack();
  }
  // the kernels have no autograd of their own: skip it, unless a double backward (create_graph)
  // records the graph, where the kernels' calls go through it as the Python Function's do
  std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
  if (!at::GradMode::is_enabled()) below_autograd.emplace();
  const bool has_residual = flags & kResidual, has_x_bias = flags & kXBias, rms_norm = flags & kRms;
  Tensor dy = std::move(grads[0]);
  if (!dy.defined()) dy = h.defined() ? at::zeros_like(h) : input_metadata(0).zeros_like();  // (only h used)
  const c10::DimVector shape(dy.sizes());  // x's (and h's)
  if (dy.dim() != 2 || !dy.is_contiguous()) dy = ff_rows(dy).contiguous();
  OptTensor dh;
  if ((flags & kPrenorm) && grads.size() > 1 && grads[1].defined()) dh = ff_rows(grads[1]).contiguous();
  Tensor h_rows = h.defined() ? ff_rows(h) : Tensor();  // (N, C): the kernels' rows (h is in x's shape)
  Tensor dx, dres, dweight, dbias, dx_bias;
  if (in_block && dispatches_to_cpu({&dy, &or_undefined(dh), &weight, &block, &philox})) {
    // the kernels read the block where the forward wrote it (no tensors made for h, mean, rstd)
    const char* base = static_cast<const char*>(block.const_data_ptr());
    std::tie(dx, dres, dweight, dbias, dx_bias) = add_layer_norm_bwd_glue_cpu(
        dy, dh, h_in_block ? base : h_rows.const_data_ptr(), weight, base + mean_at, base + rstd_at, dropout_p,
        philox, has_residual, flags & kFused, rms_norm);
  } else {
    if (in_block) {  // (a profiled or traced backward) the block's tensors, for the calls that take tensors
      Tensor h_block;
      std::tie(h_block, mean, rstd) = add_layer_norm_block_views(block, dy.size(0), dy.size(1), dy.scalar_type(),
                                                                 h_in_block, mean_at, rstd_at);
      if (h_in_block) h_rows = std::move(h_block);
    }
    if (dispatches_to_cpu({&dy, &or_undefined(dh), &h_rows, &weight, &mean, &rstd, &philox})) {
      // (as the forward's: dresidual, where it is dx, not allocated; fused on the CPU)
      std::tie(dx, dres, dweight, dbias, dx_bias) = add_layer_norm_bwd_glue_cpu(
          dy, dh, h_rows, weight, mean, rstd, dropout_p, philox, has_residual, flags & kFused, rms_norm);
    } else if (flags & kFused) {
      std::tie(dx, dres, dweight, dbias, dx_bias) =
          bwd_x_bias_op().call(dy, dh, h_rows, weight, mean, rstd, dropout_p, philox, has_residual, rms_norm);
    } else {
      std::tie(dx, dres, dweight, dbias) =
          bwd_op().call(dy, dh, h_rows, weight, mean, rstd, dropout_p, philox, has_residual, rms_norm);
      if (has_x_bias) dx_bias = at::sum(dx, at::IntArrayRef{0});  // Python's dx.sum(0)
    }
  }
  if (shape.size() != 2) dx = dx.view(shape);  // back to x's shape
  if (!has_residual) {
    dres = Tensor();
  } else if (dropout_p == 0.0) {  // the kernels return dres empty then
    dres = dx;
  } else if (shape.size() != 2) {
    dres = dres.view(shape);
  }
  // the edges: x, residual, weight, bias, x_bias
  return {std::move(dx), std::move(dres), std::move(dweight), std::move(dbias), std::move(dx_bias)};
}

// collect_next_edges' edges (an undefined tensor's an empty one), in a vector sized once (it grows
// one push_back at a time: three reallocations for five edges)
torch::autograd::edge_list next_edges(std::initializer_list<const Tensor*> ts) {
  torch::autograd::edge_list edges;
  edges.reserve(ts.size());
  for (const Tensor* t : ts) {
    edges.push_back(t->defined() ? torch::autograd::impl::gradient_edge(*t) : torch::autograd::Edge());
  }
  return edges;
}

// a kernel output (N, C) in x's shape: a view made below autograd (no node), none for 2-D x
Tensor in_shape_of(const Tensor& out, const Tensor& x) { return x.dim() == 2 ? out : out.view(x.sizes()); }

// h_returned: whether the caller receives h (the registered op's always; the entry's with prenorm)
std::tuple<Tensor, Tensor> add_layer_norm_impl(const Tensor& x, const OptTensor& residual,
                                               const Tensor& weight, const Tensor& bias, double eps,
                                               double dropout_p, bool prenorm, const Tensor& philox,
                                               const OptTensor& x_bias, bool rms_norm, bool h_returned) {
  TORCH_CHECK(!residual.has_value() || !residual->defined() || residual->sizes() == x.sizes(),
              "fastformer::add_layer_norm: residual must have the shape of x ", x.sizes(), ", got ",
              residual->sizes());
  // no graph to record (no_grad, inference_mode, or no input requiring grad): the kernel alone
  const bool record = torch::autograd::compute_requires_grad(x, residual, weight, bias, x_bias);
  if (record) ff_check_functorch();
  bool fused;
  AddLayerNormFwdGlue out;
  Tensor y, h;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the kernels: no autograd of their own
    out = run_forward(as_rows(x), as_rows(residual), weight, bias, eps, dropout_p, philox, x_bias,
                      rms_norm, h_returned, &fused);
    y = x.dim() == 2 ? std::move(out.y) : in_shape_of(out.y, x);  // (below autograd: a plain tensor, not a tracked view)
    if (out.h.defined()) h = in_shape_of(out.h, x);  // (undefined: in the block, not returned)
  }
  if (!record) return {std::move(y), std::move(h)};
  auto node = c10::make_intrusive<AddLayerNormBackward>();
  node->set_next_edges(next_edges({&x, &or_undefined(residual), &weight, &bias, &or_undefined(x_bias)}));
  torch::autograd::set_history(y, node);
  if (prenorm) torch::autograd::set_history(h, node);  // else h is returned non-differentiable
  node->weight_ = SavedVariable(weight, false);
  if (out.block.defined()) {
    node->in_block = true;
    node->h_in_block = !h.defined();
    if (h.defined()) node->h_ = SavedVariable(h, /*is_output=*/prenorm);
    node->block = std::move(out.block);
    node->mean_at = out.mean_at;
    node->rstd_at = out.rstd_at;
  } else {
    node->h_ = SavedVariable(h, /*is_output=*/prenorm);
    node->mean_ = SavedVariable(out.mean, false);
    node->rstd_ = SavedVariable(out.rstd, false);
  }
  node->philox = philox;
  node->dropout_p = dropout_p;
  node->flags = (residual.has_value() && residual->defined() ? kResidual : 0) |
                (x_bias.has_value() && x_bias->defined() ? kXBias : 0) | (fused ? kFused : 0) |
                (prenorm ? kPrenorm : 0) | (rms_norm ? kRms : 0);
  return {std::move(y), std::move(h)};
}

// the registered op: both outputs returned
std::tuple<Tensor, Tensor> add_layer_norm(const Tensor& x, const OptTensor& residual, const Tensor& weight,
                                          const Tensor& bias, double eps, double dropout_p, bool prenorm,
                                          const Tensor& philox, const OptTensor& x_bias, bool rms_norm) {
  return add_layer_norm_impl(x, residual, weight, bias, eps, dropout_p, prenorm, philox, x_bias, rms_norm, true);
}

// fastformer._C.add_layer_norm_eager(x, residual, weight, bias, eps, dropout_p, prenorm, x_bias,
// rms_norm): the op's eager call without the dispatcher, philox drawn here (csrc/eager.h): (y, h)
// with prenorm, else y. None where the call is the checked path's: not eager (autocast, a dispatch or
// function mode), an argument not what the entry takes (FFArgs), weight None, bias None
// without rms_norm, a parameter of another dtype than x (the checked path casts it), x without a
// hidden size. So the Python fast path checks nothing of its own (ops/add_layer_norm.py).
constexpr int64_t kReleaseGilNumel = int64_t{1} << 14;
PyObject* add_layer_norm_eager(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  FFArgs a(args, n, 9);
  const Tensor* x = a.tensor(0);
  const OptTensor residual = a.optional_tensor(1);
  const Tensor* weight = a.tensor(2);
  OptTensor bias = a.optional_tensor(3);
  const double eps = a.number(4), dropout_p = a.number(5);
  const bool prenorm = a.flag(6);
  OptTensor x_bias = a.optional_tensor(7);
  const bool rms_norm = a.flag(8);
  if (!a.ok) Py_RETURN_NONE;
  const auto dt = x->scalar_type();
  const int64_t C = x->dim() ? x->size(-1) : 0;
  if (!C || weight->scalar_type() != dt || (bias && bias->scalar_type() != dt) ||
      (x_bias && x_bias->scalar_type() != dt)) {
    Py_RETURN_NONE;
  }
  if (!bias) {  // RMSNorm without a bias (T5, LLaMA): the kernels add zeros, as the checked path's
    if (!rms_norm || weight->dim() != 1) Py_RETURN_NONE;
    bias = at::zeros({C}, x->options());
  }
  if (x_bias) x_bias = x_bias->contiguous();  // (an autograd copy where it is not, as the checked path's)
  std::tuple<Tensor, Tensor> out;
  {
    // the inputs built only while a profiler listens (record_shapes), as for the registered op
    RECORD_FUNCTION("fastformer::add_layer_norm", std::vector<c10::IValue>({*x, residual, *weight, *bias, eps,
                                                                             dropout_p, prenorm, x_bias, rms_norm}));
    // the GIL released as the registered op's call from Python does (torch's bindings release it
    // for every call), so that other Python threads run meanwhile; not for a small x, whose call
    // takes a few microseconds, about what releasing and taking it back costs. Holding it is safe:
    // the call runs no Python but a saved-tensor hook's, which takes the GIL this thread holds.
    std::optional<pybind11::gil_scoped_release> no_gil;
    if (x->numel() >= kReleaseGilNumel) no_gil.emplace();
    out = add_layer_norm_impl(*x, residual, *weight, *bias, eps, dropout_p, prenorm,
                              ff_philox_for(dropout_p, *a.device), x_bias, rms_norm, /*h_returned=*/prenorm);
  }
  if (!prenorm) return THPVariable_Wrap(std::move(std::get<0>(out)));
  return ff_wrap_pair(std::move(std::get<0>(out)), std::move(std::get<1>(out)));
  END_HANDLE_TH_ERRORS
}
FF_EAGER_ENTRY("add_layer_norm_eager", add_layer_norm_eager, "fastformer::add_layer_norm's eager call (csrc/eager.h).")

}  // namespace
}  // namespace fastformer

TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  // y = LayerNorm(residual + dropout(x + x_bias)) over the last dim of x (..., C) (residual: x's
  // shape), and h = residual + dropout(...), both in x's shape,
  // differentiable for prenorm (else h is returned non-differentiable). The caller draws philox.
  // rms_norm: RMSNorm instead of LayerNorm (the kernels' rms_norm).
  m.def(
      "add_layer_norm(Tensor x, Tensor? residual, Tensor weight, Tensor bias, float eps, "
      "float dropout_p, bool prenorm, Tensor philox, Tensor? x_bias, bool rms_norm=False) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastformer, CompositeImplicitAutograd, m) {
  m.impl("add_layer_norm", &fastformer::add_layer_norm);
}

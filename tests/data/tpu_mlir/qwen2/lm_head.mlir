module @"lm_head" attributes {module.chip = "ALL", module.platform = "LLM", module.state = "TOP_F32", module.top_run_mode = "STATIC", module.weight_file = "lm_head_top_weights.npz"} {
  func.func @main(%arg0: tensor<1x1x64xf32> loc(unknown)) -> tensor<1x1x256xf32> {
    %0 = "top.None"() : () -> none loc(unknown)
    %1 = "top.Input"(%arg0) : (tensor<1x1x64xf32>) -> tensor<1x1x64xf32> loc(fused["hidden_states"])
    %2 = "top.Weight"() : () -> tensor<1x1x64xf32> loc(fused["model.norm.weight"])
    %3 = "top.RMSNorm"(%1, %2) {eps = 1.0e-05 : f64} : (tensor<1x1x64xf32>, tensor<1x1x64xf32>) -> tensor<1x1x64xf32> loc(fused["final_norm"])
    %4 = "top.Weight"() : () -> tensor<64x256xf32> loc(fused["lm_head.weight"])
    %5 = "top.MatMul"(%3, %4, %0) : (tensor<1x1x64xf32>, tensor<64x256xf32>, none) -> tensor<1x1x256xf32> loc(fused["m_logits"])
    return %5 : tensor<1x1x256xf32> loc(unknown)
  } loc(unknown)
} loc(unknown)

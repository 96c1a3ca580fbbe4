module @"greedy_head" attributes {module.chip = "ALL", module.platform = "LLM", module.state = "TOP_F32", module.top_run_mode = "STATIC", module.weight_file = "greedy_head_top_weights.npz"} {
  func.func @main(%arg0: tensor<1x256xf32> loc(unknown)) -> tensor<1x1xf32> {
    %0 = "top.None"() : () -> none loc(unknown)
    %1 = "top.Input"(%arg0) : (tensor<1x256xf32>) -> tensor<1x256xf32> loc(fused["m_logits"])
    %2:2 = "top.TopK"(%1) {K = 1 : i64, axis = 1 : i64} : (tensor<1x256xf32>) -> (tensor<1x1xf32>, tensor<1x1xf32>) loc(fused["token_value", "token_id"])
    return %2#1 : tensor<1x1xf32> loc(unknown)
  } loc(unknown)
} loc(unknown)

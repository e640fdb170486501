"""The PPO update: the math (rewards, advantages, losses, logprobs), packing of real tokens
into micro-steps, the compiled loss step, and the update loop over epochs and minibatches."""

"""Reference TensorFlow/Keras training script for the benchmark: the same small CNN as
bench/model_torch.py, trained with a ``@tf.function`` step (GradientTape + Adam).

Prints the median step time so the benchmark can compare it with nondet's captured runs.
``--unseeded-noise`` adds noise from an unseeded NumPy generator at every step, so two runs
diverge at step 0 (the early-stop case). ``--narrow`` builds the narrow-activation variant
(16-32 channels, a step of about 25 ms here).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--unseeded-noise", action="store_true")
parser.add_argument("--narrow", action="store_true")
args = parser.parse_args()
c1, c2 = (16, 32) if args.narrow else (64, 128)

tf.keras.utils.set_random_seed(0)
layers = tf.keras.layers
model = tf.keras.Sequential([
    tf.keras.Input((32, 32, 3)),
    layers.Conv2D(c1, 3, padding="same"), layers.BatchNormalization(), layers.ReLU(),
    layers.Conv2D(c2, 3, padding="same"), layers.BatchNormalization(), layers.ReLU(),
    layers.MaxPooling2D(2),
    layers.Conv2D(c2, 3, padding="same"), layers.BatchNormalization(), layers.ReLU(),
    layers.MaxPooling2D(2),
    layers.Flatten(), layers.Dense(128, activation="relu"), layers.Dropout(0.1),
    layers.Dense(10),
])
optimizer = tf.keras.optimizers.Adam(1e-3)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
data = np.random.default_rng(1)
images = data.normal(size=(args.steps, args.batch, 32, 32, 3)).astype(np.float32)
labels = data.integers(0, 10, size=(args.steps, args.batch))
rng = np.random.default_rng() if args.unseeded_noise else None


@tf.function
def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss


times = []
for step in range(args.steps):
    start = time.perf_counter()
    x = images[step]
    if rng is not None:
        x = x + rng.normal(0, 0.01, x.shape).astype(np.float32)
    float(train_step(tf.constant(x), tf.constant(labels[step])))
    times.append(time.perf_counter() - start)
print(f"median_step_ms {1000 * statistics.median(times[2:]):.3f}")
print(f"total_loop_s {sum(times):.3f}")

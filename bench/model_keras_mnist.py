"""keras-io's "Simple MNIST convnet" (examples/vision/mnist_convnet.py by fchollet) as a
benchmark script: the same model, loss, optimizer, batch size and ``model.fit`` call with
``validation_split=0.1``, on seeded synthetic 28x28 digits instead of the download (no
network here). Two epochs of 6000 images: 86 training steps, two traced functions (train
and test), a plain run of about 6 s on this 2-core machine. Deterministic on the CPU.

    python bench/model_keras_mnist.py [--samples N] [--epochs N]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from keras import layers

parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=6000)
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

keras.utils.set_random_seed(1337)
rng = np.random.default_rng(0)
x_train = rng.random((args.samples, 28, 28, 1), dtype=np.float32)
y_train = keras.utils.to_categorical(rng.integers(0, 10, args.samples), 10)

model = keras.Sequential([
    keras.Input(shape=(28, 28, 1)),
    layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
    layers.MaxPooling2D(pool_size=(2, 2)),
    layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
    layers.MaxPooling2D(pool_size=(2, 2)),
    layers.Flatten(),
    layers.Dropout(0.5),
    layers.Dense(10, activation="softmax"),
])
model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
model.fit(x_train, y_train, batch_size=128, epochs=args.epochs, validation_split=0.1,
          verbose=0)

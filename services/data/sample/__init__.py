"""Data shipped with SplitMQ: ``fashion_mnist_sample.npz``.

A class-balanced subset of the official Fashion-MNIST (Xiao, Rasul, Vollgraf 2017; MIT
licence, (c) 2017 Zalando SE): 6000 train images (600 per class) and 1000 test images (100 per
class), uint8 28x28, with ``train_index`` / ``test_index`` giving each image's position in the
official split. How it was made, and the command to rebuild it, is in
``scripts/make_sample.py``. It lets the demo and the tests run with no dataset
installed. (This folder is a package only so that setuptools ships the ``.npz``.)
"""

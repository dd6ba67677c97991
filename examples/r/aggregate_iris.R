# Mean sepal length per species (Fisher's iris data).
print(aggregate(Sepal.Length ~ Species, data = iris, FUN = mean))
